"""llama.cpp's own programs as peers: the speculative decoding a llama.cpp user runs.

`make llamacpp-tools` builds them from the llama.cpp source in llama-cpp-python's sdist (the same
llama.cpp the `llamacpp` extra links) into the virtual environment's `llama.cpp/bin`. Each prompt
runs in a process of its own on the same GGUFs and threads; the time is llama.cpp's own count of
the prompt's and the generation's seconds (model loading is not counted, as a server would have
the model loaded; where its last pass ran past the tokens asked for, scaled to them), and the
counters are its own: tokens decoded, drafted and accepted.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from leapdecode.bench.memory import weights_mb
from leapdecode.bench.timing import RunOutput
from leapdecode.engine import GenerationStats, SamplingParams
from leapdecode.errors import MethodError
from leapdecode.methods import LlamaCppSpeculative
from leapdecode.models import LoadedModel

SPECULATIVE = "llama-speculative-simple"
NUMBER = r"([0-9.]+)"


def tool_path(name: str) -> Path:
    """A llama.cpp program: the one `make llamacpp-tools` built into this environment, else on PATH."""
    built = Path(sys.prefix) / "llama.cpp" / "bin" / name
    if built.is_file():
        return built
    found = shutil.which(name)
    if found is None:
        raise MethodError(f"{name} is not built: `make llamacpp-tools` builds llama.cpp's programs into {built.parent}")
    return Path(found)


def parse_speculative(log: str) -> tuple[float, int, int, int]:
    """(seconds for the prompt and the generation, tokens decoded, drafted, accepted) from
    `llama-speculative-simple`'s report."""
    encoded = re.search(rf"encoded\s+\d+ tokens in\s+{NUMBER} seconds", log)
    decoded = re.search(rf"decoded\s+(\d+) tokens in\s+{NUMBER} seconds", log)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    if not (encoded and decoded and drafted and accepted):
        raise MethodError(f"{SPECULATIVE} gave no report; its output ended with: {log[-500:]!r}")
    seconds = float(encoded.group(1)) + float(decoded.group(2))
    return seconds, int(decoded.group(1)), int(drafted.group(1)), int(accepted.group(1))


class LlamaCppSpeculativeRunner:
    """A peer: `llama-speculative-simple` (greedy), the target and the draft as llama.cpp opened them."""

    def __init__(
        self,
        lm: LoadedModel,
        method: LlamaCppSpeculative,
        draft: LoadedModel,
        label: str = "",
        sampling: SamplingParams = SamplingParams(),
    ) -> None:
        if lm.backend != "llama.cpp" or draft.backend != "llama.cpp":
            raise MethodError(f"{method.name} runs llama.cpp's own program on GGUFs: run it @llama.cpp")
        if not sampling.greedy:
            raise MethodError(f"{method.name} runs greedy only (its sampled text is not comparable token by token)")
        self.binary = tool_path(SPECULATIVE)
        self.method, self.lm, self.draft = method, lm, draft
        self.label = label or str(method)
        self.sampling = sampling
        self.weights_mb = weights_mb(lm) + weights_mb(draft)

    def command(self, prompt_file: Path, max_new_tokens: int) -> list[str]:
        # a batch of the whole context: it takes the prompt in one batch or refuses it
        model, draft, threads = self.lm.model, self.draft.model, str(self.lm.model.n_threads)
        return [
            str(self.binary), "-m", str(model.path), "-md", str(draft.path), "-f", str(prompt_file),
            "-n", str(max_new_tokens), "-t", str(threads), "-tb", str(threads), "-td", str(threads),
            "-c", str(model.n_ctx), "-b", str(model.n_ctx), "--no-escape", "--spec-type", "draft-simple",
            "--spec-draft-n-max", str(self.method.k), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", str(self.method.p_min), "--temp", "0", "--top-k", "1", "--seed", "0",
        ]  # fmt: skip

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None) -> RunOutput:
        prompt = self.lm.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        with tempfile.TemporaryDirectory() as folder:
            prompt_file = Path(folder) / "prompt.txt"
            prompt_file.write_text(prompt + "\n", encoding="utf-8")  # it drops a prompt file's last newline
            done = subprocess.run(
                self.command(prompt_file, max_new_tokens),
                capture_output=True,
                text=True,
                errors="replace",
                timeout=3600,
            )
        if done.returncode != 0:
            raise MethodError(f"{SPECULATIVE} failed ({done.returncode}): {done.stderr[-500:]}")
        seconds, decoded, drafted, accepted = parse_speculative(done.stderr + done.stdout)
        if decoded > max_new_tokens:  # its last pass may run past -n: time the tokens asked for, at its own rate
            seconds *= max_new_tokens / decoded
        text = done.stdout.removeprefix("\n\n").removesuffix("\n\n")  # its own blank lines around the text
        text = text[len(prompt) :] if text.startswith(prompt) else text  # it echoes the prompt first
        token_ids = self.lm.tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens] if text else []
        stats = GenerationStats(
            new_tokens=min(decoded, max_new_tokens),
            forward_passes=max(1, decoded - accepted),  # each target pass emits its accepted drafts and one token
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            wall_time_s=seconds,
            accepted_lengths=(),
        )
        return RunOutput(token_ids, stats)
