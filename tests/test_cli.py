"""The command line, driven through typer's test runner on the real small model."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from leapdecode.cli import app
from leapdecode.errors import InputError

runner = CliRunner()


@pytest.mark.real_model  # loads the default model
def test_generate_streams_text_and_prints_statistics() -> None:
    result = runner.invoke(app, ["generate", "--method", "anpd:n=5,k=7", "-n", "12", "def add(a, b):"])
    assert result.exit_code == 0, result.output
    assert "anpd:n=5,k=7,cost_aware=True |" in result.output
    assert "12 tokens" in result.output and "tau" in result.output


@pytest.mark.real_model  # loads the default model
def test_generate_compare_reports_equality_and_speedup() -> None:
    result = runner.invoke(app, ["generate", "--compare", "--chat", "-n", "16", "Name a colour."])
    assert result.exit_code == 0, result.output
    assert "output identical" in result.output
    assert "speed-up" in result.output


def test_bad_method_and_bad_values_exit_2_with_a_message() -> None:
    result = runner.invoke(app, ["generate", "--method", "anpd:k=0", "hi"])
    assert result.exit_code == 2
    assert "k must be >= 1" in result.output
    result = runner.invoke(app, ["generate", "--method", "warp-drive", "hi"])
    assert result.exit_code == 2 and "unknown method" in result.output
    result = runner.invoke(app, ["generate", "-n", "0", "hi"])
    assert result.exit_code == 2 and "max_new_tokens must be a positive integer" in result.output
    result = runner.invoke(app, ["generate", "--model", "not-a-model", "hi"])
    assert result.exit_code == 2 and "unknown model" in result.output


@pytest.mark.real_model  # loads the default model
def test_generate_samples_reproducibly_with_a_seed() -> None:
    args = [
        "generate",
        "--method",
        "anpd-tree",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "-n",
        "12",
        "def add(a, b):",
    ]
    first, second = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert first.stdout == second.stdout and first.stdout.strip()  # stdout is the text alone
    plain = runner.invoke(app, ["generate", "--method", "ar", *args[3:]])
    assert plain.stdout == first.stdout  # the same seed, the same text, whatever was drafted
    assert "anpd-tree:" in first.stderr and "anpd-tree:" not in first.stdout
    bad = runner.invoke(app, ["generate", "--temperature", "0.5", "--top-p", "1.5", "hi"])
    assert bad.exit_code == 2 and "top_p" in bad.output


@pytest.mark.real_model  # loads the default model
def test_forward_cost_command(tmp_path) -> None:
    result = runner.invoke(
        app,
        [
            "forward-cost",
            "--tokens",
            "1,4",
            "--context",
            "20",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    table = (tmp_path / "forward_cost.md").read_text()
    assert "| 4 |" in table and "row-exact" in table and "nn.Linear" in table and "(torch float32 row-exact" in table
    assert (tmp_path / "forward_cost.png").stat().st_size > 0


@pytest.mark.real_model  # loads the default model
def test_forward_cost_splits_a_quantized_pass_by_layer_kind(tmp_path) -> None:
    args = ["forward-cost", "--tokens", "1,4", "--context", "20", "--repeats", "1", "--layers"]
    result = runner.invoke(app, [*args, "--quantize", "int4", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    table = (tmp_path / "layers.md").read_text()
    # smollm2-135m: 30 layers, each with gate and up 576→1536
    assert "4-bit 576→1536 ×60" in table and "| all products |" in table and "| rest (attention" in table
    assert "| layers | MB | 1 row | 4 rows |" in table
    plain = runner.invoke(app, [*args, "--dtype", "float32"])
    assert plain.exit_code == 2 and "times quantized layers" in plain.output


def test_methods_and_models_listings() -> None:
    result = runner.invoke(app, ["methods"])
    assert result.exit_code == 0 and "anpd" in result.output and "lossless" in result.output
    result = runner.invoke(app, ["models", "list"])
    assert result.exit_code == 0 and "smollm2-135m" in result.output and "qwen2.5-coder-1.5b" in result.output
    result = runner.invoke(app, ["models", "pull", "gpt-17"])
    assert result.exit_code == 2 and "unknown preset" in result.output


@pytest.mark.real_model  # loads the default model
def test_demo_runs_and_reports_identical_outputs() -> None:
    result = runner.invoke(app, ["demo", "-n", "16"])
    assert result.exit_code == 0, result.output
    assert "outputs identical: yes" in result.output and "overall speed-up" in result.output


def test_help_reflows_docstrings_instead_of_breaking_lines_mid_sentence() -> None:
    """A command's docstring is one paragraph: its hard line breaks are not shown."""
    wide = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "240"})
    assert wide.exit_code == 0
    assert any("speed-up and equality (on the model's fastest path" in line for line in wide.output.splitlines())
    bench = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "240"})
    assert any(
        "write tables and plots. --backend, --dtype and --quantize" in line for line in bench.output.splitlines()
    )


def test_llama_server_is_a_peer_of_concurrent_runs_only() -> None:
    alone = runner.invoke(app, ["bench", "--methods", "ar,llama-server", "--limit", "1", "-n", "4"])
    assert alone.exit_code == 2 and "run it with --concurrency" in alone.output
    mixed = runner.invoke(app, ["bench", "--methods", "ar,hf-pld", "--concurrency", "1", "--limit", "1", "-n", "4"])
    assert mixed.exit_code == 2 and "leave out other peers" in mixed.output


def test_a_prefix_cache_size_is_checked_before_anything_loads() -> None:
    alone = runner.invoke(app, ["bench", "--methods", "ar", "--prefix-cache-tokens", "64", "--limit", "1", "-n", "4"])
    assert alone.exit_code == 2 and "--prefix-cache-tokens" in alone.output and "--concurrency" in alone.output
    negative = runner.invoke(app, ["serve", "--prefix-cache-tokens", "-1"])
    assert negative.exit_code == 2 and "--prefix-cache-tokens" in negative.output


@pytest.mark.real_model  # loads the default model
def test_chat_answers_turn_after_turn_each_from_the_last_turns_cache() -> None:
    result = runner.invoke(
        app, ["chat", "-n", "8", "--method", "anpd", "--system", "Be brief."], input="Name a colour.\nAnd another?\n"
    )
    assert result.exit_code == 0, result.output
    stats = [line for line in result.output.splitlines() if "from the last turns' cache" in line]
    assert len(stats) == 2 and " 0 from the last turns' cache" in stats[0]
    assert " 0 from the last turns' cache" not in stats[1]  # the second turn started from the first's
    bad = runner.invoke(app, ["chat", "--prefix-cache-tokens", "-1"], input="hi\n")
    assert bad.exit_code == 2 and "--prefix-cache-tokens" in bad.output


def test_a_bench_system_message_is_checked_before_the_model_loads() -> None:
    empty = runner.invoke(
        app, ["bench", "-d", "spec-bench:qa", "--methods", "ar", "--system", "  ", "--limit", "1", "-n", "4"]
    )
    assert empty.exit_code == 2 and "--system" in empty.output and "non-empty" in empty.output
    from leapdecode.bench.datasets import BenchPrompt, with_system

    with pytest.raises(InputError, match="chat template"):
        with_system([BenchPrompt("1", "code", "def add(a, b):", chat=False)], "Be brief.")
    chosen = with_system([BenchPrompt("1", "qa", "Why is the sky blue?")], "Be brief.")
    assert chosen[0].system == "Be brief." and chosen[0].text == "Why is the sky blue?"
