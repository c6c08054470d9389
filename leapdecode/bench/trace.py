"""A step-by-step view of decoding (the ANPD paper's Figure 6): per target forward pass, which
drafted tokens were accepted, which were rejected, and the target's own bonus token."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text

from leapdecode.api import GenerationResult
from leapdecode.engine import Step, compile_tree


@dataclass(frozen=True)
class TraceStep:
    index: int
    accepted: tuple[str, ...]  # drafted tokens the target kept
    bonus: str | None  # the target's own token (None if a stop cut the step short)
    rejected: tuple[str, ...]  # drafted tokens the target discarded
    branches: tuple[tuple[int, str], ...] = ()  # a tree draft: (tokens accepted, text) per root-to-leaf branch


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def trace_steps(result: GenerationResult, tokenizer: Any) -> list[TraceStep]:
    steps = []
    for i, step in enumerate(result.steps):
        emitted = token_texts(tokenizer, step.tokens)
        n = min(step.num_accepted, len(emitted))
        on_path = set(step.path)
        rejected = [t for j, t in enumerate(step.drafted) if j not in on_path]
        steps.append(
            TraceStep(
                index=i,
                accepted=tuple(emitted[:n]),
                bonus=emitted[n] if len(emitted) > n else None,
                rejected=tuple(token_texts(tokenizer, rejected)),
                branches=tree_branches(step, tokenizer),
            )
        )
    return steps


def tree_branches(step: Step, tokenizer: Any) -> tuple[tuple[int, str], ...]:
    """Each root-to-leaf branch of a tree draft, with how many of its tokens were accepted."""
    if step.parents is None:
        return ()
    tree = compile_tree(step.parents)
    accepted = [j + 1 for j in step.path]
    out = []
    for node in range(1, tree.num_nodes):
        if tree.children[node]:
            continue
        branch = tree.path_to(node)
        kept = next((k for k, (a, b) in enumerate(zip(branch, accepted)) if a != b), min(len(branch), len(accepted)))
        out.append((kept, tokenizer.decode([step.drafted[j - 1] for j in branch], skip_special_tokens=False)))
    return tuple(out)


def _visible(text: str) -> str:
    return text.replace("\n", "↵\n").replace("\t", "→   ")


def render_terminal(steps: Sequence[TraceStep], show_rejected: bool = True) -> Text:
    """Accepted drafts on green, bonus tokens on yellow, rejected drafts struck through in red."""
    out = Text()
    for step in steps:
        for tok in step.accepted:
            out.append(_visible(tok), style="black on green3")
        if step.bonus is not None:
            out.append(_visible(step.bonus), style="black on yellow")
        if show_rejected and step.branches:
            out.append(f"[tree: {len(step.branches)} branches, {len(step.rejected)} rejected]", style="red dim")
        elif show_rejected and step.rejected:
            out.append("[" + "".join(step.rejected).replace("\n", "↵") + "]", style="red strike dim")
        out.append("│", style="dim")
    return out


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; color: #222; }
h1 { font-size: 1.3em; } .meta { color: #555; font-size: 0.9em; }
.legend span { padding: 0 .4em; margin-right: 1em; border-radius: 3px; }
.text { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 2.1; font-size: 15px;
        border: 1px solid #ddd; padding: 1em; border-radius: 6px; background: #fcfcfc; }
.step { border-bottom: 2px solid #d33; margin-right: 2px; padding-bottom: 1px; }
.acc { background: #a8e6b4; } .bonus { background: #ffe066; }
.rej { color: #c22; text-decoration: line-through; font-size: 75%; opacity: .75; }
table { border-collapse: collapse; font-size: .85em; margin-top: 1.5em; }
td, th { border: 1px solid #ddd; padding: .2em .6em; text-align: left; font-family: ui-monospace, monospace; }
th { background: #f3f3f3; }
"""


def _rejected_cell(step: TraceStep) -> str:
    """Rejected drafts; for a tree, every branch with its accepted prefix marked."""
    if not step.branches:
        return html.escape("".join(step.rejected))
    lines = []
    for kept, text in step.branches:
        mark = "✓" if kept else "✗"
        lines.append(
            f'<span class="{"acc" if kept else "rej"}">{mark} {html.escape(text.replace(chr(10), "↵"))}</span>'
        )
    return "<br>".join(lines)


def render_html(result: GenerationResult, steps: Sequence[TraceStep], model: str, prompt: str) -> str:
    """A self-contained page: the text with each step underlined, and a table of steps."""
    esc = html.escape
    body = []
    for step in steps:
        parts = [f'<span class="acc">{esc(t)}</span>' for t in step.accepted]
        if step.bonus is not None:
            parts.append(f'<span class="bonus">{esc(step.bonus)}</span>')
        if step.branches:
            parts.append(f'<span class="rej">[tree: {len(step.branches)} branches]</span>')
        elif step.rejected:
            parts.append(f'<span class="rej">{esc("".join(step.rejected).replace(chr(10), "↵"))}</span>')
        title = f"step {step.index}: {len(step.accepted)} accepted of {len(step.accepted) + len(step.rejected)} drafted"
        body.append(f'<span class="step" title="{esc(title)}">{"".join(parts)}</span>')
    rows = "\n".join(
        f"<tr><td>{s.index}</td><td>{len(s.accepted) + len(s.rejected)}</td><td>{len(s.accepted)}</td>"
        f"<td>{esc(''.join(s.accepted))}</td><td>{esc(s.bonus or '')}</td><td>{_rejected_cell(s)}</td></tr>"
        for s in steps
    )
    st = result.stats
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>leapdecode trace: {esc(result.method)}</title>
<style>{_CSS}</style></head><body>
<h1>Decoding trace: <code>{esc(result.method)}</code> on <code>{esc(model)}</code></h1>
<p class="meta">{st.new_tokens} new tokens in {st.forward_passes} target forward passes
(τ = {st.tau:.2f} tokens per pass), draft hit ratio α = {st.alpha:.2f}
({st.accepted_tokens}/{st.drafted_tokens}), {st.tokens_per_s:.1f} tokens/s,
finish reason: {esc(result.finish_reason)}.</p>
<p class="legend"><span class="acc">accepted draft token</span><span class="bonus">bonus token (the target's own)</span>
<span class="rej">rejected draft</span>
each underline = one forward pass of the target model</p>
<details><summary>Prompt</summary><pre>{esc(prompt)}</pre></details>
<div class="text">{"".join(body)}</div>
<table><tr><th>step</th><th>drafted</th><th>accepted</th><th>accepted tokens</th><th>bonus</th>
<th>rejected (trees: every branch, ✓ where the accepted path runs)</th></tr>
{rows}
</table>
</body></html>
"""
