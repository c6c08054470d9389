"""The benchmark, the trace and their pages, end to end on the real small model."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess

import pytest
from typer.testing import CliRunner

from leapdecode import wrap
from leapdecode.bench.trace import render_html, trace_steps
from leapdecode.cli import app

runner = CliRunner()

pytestmark = pytest.mark.real_model  # every benchmark here runs the real small model


def test_bench_command_writes_tables_plots_and_checks_every_sample(tmp_path) -> None:
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        [
            "bench",
            "--dataset",
            "humaneval+spec-bench:translation",
            "--limit",
            "1",
            "-n",
            "12",
            "--methods",
            "ar,anpd:n=4,k=5,pld,hf,hf-pld:tokens=5",
            "--out",
            str(out),
            "--threads",
            "1",
            "--repeats",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    for name in ("samples.jsonl", "summary.json", "results.md", "speedup_by_category.png", "accepted_lengths.png"):
        assert (out / name).stat().st_size > 0
    table = (out / "results.md").read_text()
    assert "Lossless check: all 4 samples equal plain decoding" in table  # anpd and pld; hf and hf-pld are peers
    assert "HumanEval" in table and "Translation" in table and "`hf-pld:tokens=5`" in table  # defaults left out
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(
        len(s["wall_time_runs"]) == 2 and s["wall_time_s"] == statistics.median(s["wall_time_runs"]) for s in samples
    )
    assert "–" in table.split("`anpd:n=4,k=5`")[1].split("\n")[0]  # the spread of the two repeats
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert meta["date"] and meta["version"] and meta["threads"] == 1 and "commit" in meta


def test_bench_runs_other_dtypes_and_quantizations_in_the_same_run(tmp_path) -> None:
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        [
            "bench",
            "--dataset",
            "humaneval",
            "--limit",
            "1",
            "-n",
            "12",
            "--out",
            str(out),
            "--threads",
            "1",
            "--no-plots",
            "--dtype",
            "float32",
            "--methods",
            "ar,anpd,ar@bfloat16,anpd@bfloat16,hf@bfloat16,ar@int4,draft:model=smollm2-135m,k=3@int4",
        ],
    )
    assert result.exit_code == 0, result.output
    table = (out / "results.md").read_text()
    assert (
        "Lossless check: all 3 samples equal plain decoding" in table
    )  # each against its own model's ar; hf is a peer
    samples = {s["method"]: s for s in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}
    assert samples["ar@bfloat16"]["equal_to_plain"] is None and samples["hf@bfloat16"]["equal_to_plain"] is True
    assert "Against plain decoding on the same model, `ar@bfloat16`" in table
    assert "Against plain decoding on the same model, `ar@int4`" in table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["weights"] != "" and set(summary["against_own_plain"]) == {"bfloat16", "int4"}


def test_sampled_bench_checks_every_sample_against_plain_sampling(tmp_path) -> None:
    """With a temperature, each lossless method's text equals plain sampling's with the prompt's seed."""
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        [
            "bench",
            "--dataset",
            "humaneval+spec-bench:summarization",
            "--limit",
            "1",
            "-n",
            "16",
            "--out",
            str(out),
            "--threads",
            "1",
            "--no-plots",
            "--temperature",
            "0.8",
            "--top-p",
            "0.95",
            "--seed",
            "3",
            "--methods",
            "ar,anpd,pld,suffix,anpd-tree,hf",
        ],
    )
    assert result.exit_code == 0, result.output
    table = (out / "results.md").read_text()
    assert "Lossless check: all 8 samples equal plain decoding" in table and "sampled: temperature 0.8" in table
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert (
        meta["decoding"].startswith("sampled") and "int4" in meta["weights"]
    )  # the preset's own blocks, without flags


def test_a_variant_that_is_the_runs_own_model_needs_no_loader(real_lm) -> None:
    from leapdecode.bench.datasets import load_dataset
    from leapdecode.bench.entries import parse_entries
    from leapdecode.bench.runner import run_benchmark
    from leapdecode.errors import MethodError

    prompt = load_dataset("humaneval", limit=1)
    samples = run_benchmark(real_lm, parse_entries("anpd:cost_aware=false@torch"), prompt, 8, warmup_prompts=0)
    assert [s.method for s in samples] == ["ar", "anpd:n=5,k=7,cost_aware=False"] and samples[1].equal_to_plain
    with pytest.raises(MethodError, match="cannot load the model @int8"):
        run_benchmark(real_lm, parse_entries("anpd@int8"), prompt, 8, warmup_prompts=0)


def test_sweep_command(tmp_path) -> None:
    out = tmp_path / "sweep"
    result = runner.invoke(
        app, ["sweep", "--grid", "n=2,3 k=1,4", "--limit", "1", "-n", "8", "--out", str(out), "--quantize", "int4"]
    )
    assert result.exit_code == 0, result.output
    assert "(torch int4 row-exact" in (out / "sweep.md").read_text()
    assert (out / "sweep_heatmap.png").stat().st_size > 0 and (out / "sweep_lines.png").stat().st_size > 0
    assert "| 2 |" in (out / "sweep.md").read_text()


def test_trace_marks_accepted_bonus_and_rejected_tokens(real_lm) -> None:
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox"
    result = wrap(real_lm, "anpd").generate(prompt, max_new_tokens=24)
    steps = trace_steps(result, real_lm.tokenizer)
    assert len(steps) == result.stats.forward_passes
    assert sum(len(s.accepted) for s in steps) == result.stats.accepted_tokens
    assert all(s.bonus is not None for s in steps[:-1])
    page = render_html(result, steps, real_lm.name, prompt)
    assert page.count('class="step"') == len(steps)
    assert page.count('class="acc"') == result.stats.accepted_tokens + 1  # + the legend's sample


def test_trace_lists_every_branch_of_a_tree_draft(real_lm) -> None:
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox"
    result = wrap(real_lm, "anpd-tree").generate(prompt, max_new_tokens=24)
    steps = trace_steps(result, real_lm.tokenizer)
    trees = [s for s in steps[:-1] if s.branches]
    assert trees and sum(len(s.accepted) for s in steps) == result.stats.accepted_tokens
    for s in trees:  # the accepted path lies along one branch, whole
        assert max(kept for kept, _ in s.branches) == len(s.accepted)
    page = render_html(result, steps, real_lm.name, prompt)
    assert "✓" in page and "[tree:" in page


def find_chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    assert path, "headless Chromium is needed for this test: `make test` installs Debian's chromium (apt-get)"
    return path


@pytest.mark.browser
def test_trace_page_renders_in_headless_chromium(tmp_path) -> None:
    import matplotlib.image

    page = tmp_path / "trace.html"
    result = runner.invoke(
        app,
        [
            "trace",
            "--method",
            "anpd",
            "-n",
            "40",
            "--out",
            str(page),
            "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return",
        ],
    )
    assert result.exit_code == 0, result.output
    shot = tmp_path / "trace.png"
    subprocess.run(
        [
            find_chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1000,700",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = matplotlib.image.imread(shot)[..., :3]  # [H, W, 3] floats in [0, 1]
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 900
    yellow = ((pixels[..., 0] > 0.95) & (pixels[..., 1] > 0.8) & (pixels[..., 2] < 0.5)).sum()  # bonus tokens
    assert yellow > 200, "the bonus-token highlighting did not render"
    assert pixels.std() > 0.05  # not a blank page


def test_the_second_mt_bench_turn_runs_after_the_first_and_its_plain_answer(real_lm) -> None:
    from leapdecode.api import encode_prompt
    from leapdecode.bench.datasets import load_dataset
    from leapdecode.bench.runner import encode_turns, run_benchmark
    from leapdecode.methods import parse_method

    first, second = load_dataset("spec-bench:multi-turn", limit=2)
    samples = run_benchmark(
        real_lm, [parse_method("suffix"), parse_method("hybrid")], [first, second], 12, warmup_prompts=0
    )
    assert [s.prompt_id for s in samples] == ["81"] * 3 + ["81-turn2"] * 3
    assert all(s.equal_to_plain for s in samples if s.method != "ar")
    answer = wrap(real_lm, "ar").generate(encode_prompt(real_lm, first.text, chat=True), max_new_tokens=12).token_ids
    ids = encode_turns(
        real_lm, second, lambda prompt_ids: wrap(real_lm, "ar").generate(prompt_ids, max_new_tokens=12).token_ids
    )
    reply = real_lm.tokenizer.decode(answer, skip_special_tokens=True)
    assert (
        reply.strip()
        and reply.strip() in real_lm.tokenizer.decode(ids)
        and second.text in real_lm.tokenizer.decode(ids)
    )
    assert samples[3].prompt_tokens == len(ids) > samples[0].prompt_tokens + len(answer)


def test_untimed_runs_leave_no_trace_in_a_shared_method(real_lm) -> None:
    from leapdecode.api import encode_prompt
    from leapdecode.bench.runner import EngineRunner
    from leapdecode.methods import parse_method

    ids = encode_prompt(real_lm, "Write a short poem about the sea.", chat=True)
    method = parse_method("suffix:shared=true,cost_aware=false,factor=8")
    fresh = EngineRunner(real_lm, method).run(ids, 24)
    runner = EngineRunner(real_lm, method)
    runner.warm(ids, 24)  # a warm-up must not feed the timed decoder's index
    assert runner.run(ids, 24).stats.forward_passes == fresh.stats.forward_passes
    again = runner.run(ids, 24)  # the timed decoder's own earlier request does
    assert again.token_ids == fresh.token_ids and again.stats.forward_passes < fresh.stats.forward_passes


SYSTEM = (
    "You are the help desk of a small library. Answer in two sentences at most, in plain words, and never "
    "invent opening hours, fees or book titles. If you do not know, say so and suggest asking at the front desk."
)


def test_concurrent_bench_with_one_system_message_shares_its_prefill(tmp_path) -> None:
    """`bench --concurrency --system`: every request begins with the same system message, so with a
    prefix cache the requests after the first take it from a cache instead of a prefill (counted
    in the table), and every output still equals plain decoding's alone."""
    out = tmp_path / "bench"
    args = ["bench", "-d", "spec-bench:qa", "--limit", "3", "-n", "8", "--methods", "ar,anpd"]
    args += ["--concurrency", "1,3", "--prefix-cache-tokens", "4096", "--system", SYSTEM, "--threads", "1"]
    result = runner.invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "concurrency.json").read_text())
    system_tokens = int(data["meta"]["system message"].split()[0])
    assert system_tokens > 30
    rows = {(r["method"], r["concurrency"]): r for r in data["results"]}
    assert len(rows) == 6 and {c for _, c in rows} == {"solo", "1", "3"}
    table = (out / "concurrency.md").read_text()
    for (_, clients), r in rows.items():
        assert r["identical"] == r["requests"] == 3 and r["prompt_tokens"] > 3 * system_tokens
        if clients != "solo":  # the second and third requests start from a cache holding at least the system message
            assert r["cached_tokens"] >= 2 * system_tokens
            assert f"| {r['cached_tokens']}/{r['prompt_tokens']} | 3/3 |" in table
    assert f"system message: {system_tokens} tokens" in table and "prompt tokens cached" in table


def test_a_system_message_comes_before_every_turn_and_its_earlier_answers(real_lm) -> None:
    from leapdecode.api import encode_prompt
    from leapdecode.bench.datasets import load_dataset, with_system
    from leapdecode.bench.runner import encode_turns

    first, second = with_system(load_dataset("spec-bench:multi-turn", limit=2), SYSTEM)
    assert encode_turns(real_lm, first, lambda ids: []) == encode_prompt(
        real_lm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first.text}]
    )
    asked: list[str] = []

    def answer(ids: list[int]) -> list[int]:
        asked.append(real_lm.tokenizer.decode(ids))
        return real_lm.tokenizer("A short reply.", add_special_tokens=False)["input_ids"]

    text = real_lm.tokenizer.decode(encode_turns(real_lm, second, answer))
    assert len(asked) == 1 and SYSTEM in asked[0] and first.text in asked[0]  # the earlier turn, answered after it
    assert text.index(SYSTEM) < text.index(first.text) < text.index("A short reply.") < text.index(second.text)
    assert text.count(SYSTEM) == 1
