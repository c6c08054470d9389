"""The benchmark's arithmetic on hand-made timings, the mismatch report, datasets, grids."""

from __future__ import annotations

import json

import pytest

from leapdecode.bench import readme_table, report
from leapdecode.bench.datasets import HUMANEVAL_TEMPLATE, load_dataset
from leapdecode.bench.entries import parse_methods
from leapdecode.bench.harness import parse_grid
from leapdecode.bench.runner import Sample, first_difference
from leapdecode.errors import InputError, MethodError
from leapdecode.methods import METHODS, Anpd, Autoregressive, HfPromptLookup
from tests.helpers import length_parameter


def sample(method, pid, cat, time, tokens=10, passes=10, drafted=0, accepted=0, equal=None, diff=None, lossless=True):
    return Sample(
        method=method,
        prompt_id=pid,
        category=cat,
        prompt_tokens=5,
        new_tokens=tokens,
        wall_time_s=time,
        forward_passes=passes,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        accepted_lengths=[],
        tau=tokens / passes,
        alpha=accepted / drafted if drafted else 0.0,
        tokens_per_s=tokens / time,
        lossless=lossless,
        equal_to_plain=equal,
        first_difference=diff,
    )


@pytest.fixture
def samples():
    return [
        sample("ar", "a", "qa", 2.0),
        sample("anpd:n=5,k=7", "a", "qa", 1.0, passes=5, drafted=14, accepted=5, equal=True),
        sample("ar", "b", "qa", 4.0),
        sample("anpd:n=5,k=7", "b", "qa", 1.0, passes=4, drafted=14, accepted=6, equal=True),
        sample("ar", "c", "humaneval", 3.0),
        sample("anpd:n=5,k=7", "c", "humaneval", 3.0, passes=10, drafted=7, accepted=0, equal=False, diff=4),
    ]


def test_speedup_is_a_ratio_of_total_times_not_a_mean_of_ratios(samples) -> None:
    aggs = report.aggregate(samples)
    qa = aggs[("anpd:n=5,k=7", "qa")]
    assert qa.speedup == pytest.approx(6.0 / 2.0)  # not (2 + 4) / 2 = 3 by coincidence: check overall too
    overall = aggs[("anpd:n=5,k=7", "overall")]
    assert overall.speedup == pytest.approx(9.0 / 5.0)  # mean of ratios would be (2 + 4 + 1) / 3 = 2.33
    assert aggs[("ar", "overall")].speedup == pytest.approx(1.0)


def test_tau_and_alpha_are_pooled_over_prompts(samples) -> None:
    overall = report.aggregate(samples)[("anpd:n=5,k=7", "overall")]
    assert overall.stats.tau == pytest.approx(30 / 19)
    assert overall.stats.alpha == pytest.approx(11 / 35)
    assert overall.stats.tokens_per_s == pytest.approx(30 / 5.0)
    assert overall.mismatches == 1


def test_markdown_table_has_a_column_per_category_and_the_bound(samples) -> None:
    table = report.markdown_table(samples, {"anpd:n=5,k=7": 7})
    header = table.splitlines()[0]
    assert header.index("QA") < header.index("HumanEval") < header.index("Overall speed-up")
    anpd_row = next(line for line in table.splitlines() if line.startswith("| `anpd"))
    assert "3.00x (τ 2.22)" in anpd_row and "**1.80x**" in anpd_row
    assert f"{11 / 35 * 7 + 1:.2f}" in anpd_row
    assert "**2/3**" in anpd_row  # two of three identical: flagged


def test_mismatch_report_names_prompt_and_first_differing_position(samples) -> None:
    text = report.mismatch_report(samples)
    assert "FAILED: 1 of 3" in text
    assert "| `anpd` | c | humaneval | 4 |" in text  # n=5,k=7 are anpd's defaults
    ok = [s for s in samples if s.prompt_id != "c"]
    assert report.mismatch_report(ok) == "Lossless check: all 2 samples equal plain decoding token for token."


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_write_outputs(tmp_path, samples) -> None:
    paths = report.write_outputs(tmp_path, samples, {"model": "m", "prompts": 3}, {"anpd:n=5,k=7": 7})
    rows = [json.loads(line) for line in paths["samples"].read_text().splitlines()]
    assert len(rows) == 6 and rows[1]["equal_to_plain"] is True
    summary = json.loads(paths["summary"].read_text())
    assert any(r["method"] == "anpd:n=5,k=7" and r["category"] == "overall" for r in summary["results"])
    assert "Lossless check FAILED" in paths["table"].read_text()


def test_parse_methods_groups_parameters_with_their_method() -> None:
    methods = parse_methods("ar,anpd:n=5,k=7,hf-pld:tokens=10")
    assert methods == [Autoregressive(), Anpd(n=5, k=7), HfPromptLookup(tokens=10)]
    with pytest.raises(MethodError, match="listed twice"):
        parse_methods("anpd,anpd:n=5")
    with pytest.raises(MethodError, match="unknown method"):
        parse_methods("ar,warp")


def test_entries_name_a_backend_with_at() -> None:
    from leapdecode.bench.entries import Variant, parse_entries

    entries = parse_entries("llama-cpp,anpd:n=5,k=7,cost_aware=false,ar@torch,anpd:n=5,k=7@torch")
    assert [e.label for e in entries] == [
        "llama-cpp",
        "anpd:n=5,k=7,cost_aware=False",
        "ar@torch",
        "anpd:n=5,k=7,cost_aware=True@torch",
    ]
    assert entries[3].method == Anpd(n=5, k=7) and entries[3].variant == Variant(backend="torch")
    with pytest.raises(MethodError, match="unknown backend or weights 'onnx'"):
        parse_entries("anpd@onnx")
    with pytest.raises(MethodError, match="listed twice"):
        parse_entries("ar@torch,ar@torch")


def test_entries_name_a_dtype_or_quantization_with_at() -> None:
    from leapdecode.bench.entries import Variant, parse_entries

    entries = parse_entries("ar,ar@bfloat16,anpd@BFloat16,hf@bfloat16,ar@int4,anpd:n=3@torch+int4")
    assert [str(e.variant) for e in entries] == ["", "bfloat16", "bfloat16", "bfloat16", "int4", "torch+int4"]
    assert entries[5].variant == Variant(backend="torch", quantize="int4") and entries[5].method == Anpd(n=3)
    for bad, message in [
        ("anpd@int4+int8", "two of one kind"),
        ("anpd@llama.cpp+int4", "GGUF's own types"),
        ("anpd@bfloat16+int4", "compute in float32"),
        ("anpd@", "unknown backend or weights ''"),
    ]:
        with pytest.raises(MethodError, match=message):
            parse_entries(bad)


@pytest.mark.parametrize(
    ("variant", "run", "loads"),
    [
        ("", ("torch", "float32", "int4"), ("torch", "float32", "int4")),
        ("bfloat16", ("torch", "float32", "int4"), ("torch", "bfloat16", "none")),  # its own dtype drops the run's int4
        ("int4", ("torch", "bfloat16", "none"), ("torch", "float32", "int4")),  # int4 computes in float32
        ("torch", ("llama.cpp", "float32", "int4"), ("torch", "float32", "int4")),  # the run's torch settings
        ("torch+bfloat16", ("llama.cpp", "float32", "none"), ("torch", "bfloat16", "none")),
        ("llama.cpp", ("torch", "bfloat16", "none"), ("llama.cpp", "", "none")),
        ("int4", ("llama.cpp", "float32", "none"), ("torch", "float32", "int4")),  # only torch takes a quantization
    ],
)
def test_a_variant_loads_with_the_runs_settings_where_it_names_none(variant, run, loads) -> None:
    from leapdecode.bench.entries import Variant

    parsed = Variant.parse(variant) if variant else Variant()
    assert parsed.load_arguments(*run) == loads


def test_variants_get_a_table_against_their_own_plain_decoding(tmp_path) -> None:
    samples = [
        sample("ar", "a", "qa", 8.0),
        sample("ar@bfloat16", "a", "qa", 4.0, equal=None),
        sample("anpd@bfloat16", "a", "qa", 1.0, passes=4, drafted=8, accepted=6, equal=True),
        sample("anpd", "a", "qa", 2.0, passes=4, drafted=8, accepted=6, equal=True),
    ]
    assert report.variants_with_own_plain(samples) == ["bfloat16"]
    own = report.aggregate(report.on_variant(samples, "bfloat16"))
    assert own[("anpd", "overall")].speedup == pytest.approx(4.0) and own[("ar", "overall")].speedup == pytest.approx(
        1.0
    )
    assert report.aggregate(samples)[("anpd@bfloat16", "overall")].speedup == pytest.approx(8.0)  # against the run's ar
    paths = report.write_outputs(tmp_path, samples, {"model": "m", "prompts": 1}, {"anpd@bfloat16": 7, "anpd": 7})
    table = paths["table"].read_text()
    assert "Against plain decoding on the same model, `ar@bfloat16`" in table
    assert "| `anpd` | 4.00x (τ 2.50)" in table.split("`ar@bfloat16`:")[1]
    summary = json.loads(paths["summary"].read_text())
    row = next(
        r for r in summary["against_own_plain"]["bfloat16"] if r["method"] == "anpd" and r["category"] == "overall"
    )
    assert row["speedup"] == pytest.approx(4.0)


def test_agreement_is_pooled_by_tokens_for_lossy_methods() -> None:
    samples = [
        sample("ar", "a", "qa", 2.0),
        sample("ar", "b", "qa", 2.0),
        sample("calm:threshold=0.9", "a", "qa", 1.0, equal=False, diff=3, lossless=False),
        sample("calm:threshold=0.9", "b", "qa", 1.0, equal=False, diff=1, lossless=False),
    ]
    samples[2].agreement, samples[2].new_tokens = 1.0, 30
    samples[3].agreement, samples[3].new_tokens = 0.5, 10
    agg = report.aggregate(samples)[("calm:threshold=0.9", "overall")]
    assert agg.agreement == pytest.approx((30 * 1.0 + 10 * 0.5) / 40)
    assert report.aggregate(samples)[("ar", "overall")].agreement is None
    assert "| 0.875 |" in report.markdown_table(samples)


def test_datasets() -> None:
    he = load_dataset("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[0].chat
    assert he[0].text.startswith(HUMANEVAL_TEMPLATE.split("{")[0]) and "def has_close_elements" in he[0].text
    sb = load_dataset("spec-bench", limit=3)
    cats = {p.category for p in sb}
    assert cats == {"multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert len(sb) == 18
    turns = load_dataset("spec-bench:multi-turn")
    assert len(turns) == 160 and [p.id for p in turns[:2]] == ["81", "81-turn2"]  # both MT-Bench turns
    assert turns[1].earlier == (turns[0].text,) and not turns[0].earlier
    assert {p.category for p in load_dataset("spec-bench:rag", limit=2)} == {"rag"}
    assert len(load_dataset("humaneval+spec-bench:qa", limit=2)) == 4
    assert len(load_dataset("humaneval+spec-bench:qa", limit="2,humaneval=5")) == 7


def test_dataset_errors(tmp_path) -> None:
    with pytest.raises(InputError, match="unknown dataset"):
        load_dataset("mmlu")
    with pytest.raises(InputError, match="positive"):
        load_dataset("humaneval", limit="0")
    with pytest.raises(InputError, match="CATEGORY=N"):
        load_dataset("humaneval", limit="ten")
    with pytest.raises(InputError, match="unknown Spec-Bench category"):
        load_dataset("spec-bench:poetry")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"turns": []}\n')
    with pytest.raises(InputError, match="bad.jsonl:2"):
        load_dataset(str(bad))
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello", "category": "x", "question_id": 7}\n\n{"turns": ["hi", "again"]}\n')
    prompts = load_dataset(str(good))
    assert [(p.id, p.category, p.text, p.earlier) for p in prompts] == [
        ("7", "x", "hello", ()),
        ("3", "default", "hi", ()),
        ("3-turn2", "default", "again", ("hi",)),
    ]


def test_parse_grid() -> None:
    assert parse_grid("n=2..4 k=1,3") == {"n": [2, 3, 4], "k": [1, 3]}
    with pytest.raises(InputError):
        parse_grid("n=4..2")
    with pytest.raises(InputError):
        parse_grid("n=a..b")
    with pytest.raises(InputError):
        parse_grid("n=1 k=2 m=3")


def test_readme_table_is_written_between_markers(tmp_path, samples) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results-table -->\nold\n<!-- results-table -->\nafter\n")
    table = readme_table.readme_table(
        samples, {"model": "m", "prompts": 3, "dataset": "d", "limit": 1, "max_new_tokens": 8, "machine": "x"}
    )
    readme_table.update_readme(readme, table)
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("after\n")
    assert "**1.80x**" in text and "**1 of 3 samples differ**" in text
    readme_table.update_readme(readme, "new table")  # idempotent: replaces again between the markers
    assert readme.read_text().count("<!-- results-table -->") == 2 and "**1.80x**" not in readme.read_text()


def test_repeats_give_the_median_and_the_spread_of_the_speed_up() -> None:
    from dataclasses import replace

    from leapdecode.bench.report import aggregate

    plain = [
        replace(sample("ar", "p1", "qa", 2.0), wall_time_runs=[2.0, 2.2]),
        replace(sample("ar", "p2", "qa", 4.0), wall_time_runs=[4.0, 3.8]),
    ]
    fast = [
        replace(sample("anpd", "p1", "qa", 1.0, equal=True), wall_time_runs=[1.0, 1.4]),
        replace(sample("anpd", "p2", "qa", 2.0, equal=True), wall_time_runs=[2.0, 2.6]),
    ]
    agg = aggregate(plain + fast)[("anpd", "overall")]
    # repeat 0: 6.0 / 3.0 = 2.0; repeat 1: 6.0 / 4.0 = 1.5
    assert agg.speedup_range == (1.5, 2.0)
    assert aggregate(plain[:1] + fast[:1])[("anpd", "overall")].speedup_range == (2.2 / 1.4, 2.0)
    assert (
        aggregate([sample("ar", "p1", "qa", 2.0), sample("anpd", "p1", "qa", 1.0)])[("anpd", "overall")].speedup_range
        is None
    )


@pytest.mark.parametrize(
    ("label", "short"),
    [
        ("anpd:n=5,k=7", "anpd"),  # every parameter its default
        ("anpd:n=5,k=7,cost_aware=True", "anpd"),
        ("anpd:n=4,k=7,cost_aware=False", "anpd:n=4,cost_aware=False"),  # only what differs, in field order
        (
            "hybrid:k=8,nodes=8,depth=4,width=4,cost_aware=True,suffix_k=16,factor=1.0,min_match=1,min_prob=0.1,index_tokens=65536@int4",
            "hybrid@int4",
        ),
        ("draft:model=qwen2.5-coder-0.5b,k=5", "draft:model=qwen2.5-coder-0.5b"),  # a name has no default to drop
        ("hf-pld:tokens=5,max_ngram=2@bfloat16", "hf-pld:tokens=5@bfloat16"),  # the variant stays
        ("anpd@torch+int4", "anpd@torch+int4"),
        ("ar", "ar"),
        (
            "ar@llama.cpp",
            "llama.cpp plain",
        ),  # llama.cpp computing the passes, not this engine's plain decoding on torch
        ("gone:x=1", "gone:x=1"),  # a method that no longer parses keeps its recorded string
    ],
)
def test_short_label_keeps_only_what_differs_from_the_defaults(label, short) -> None:
    from leapdecode.bench.labels import short_label

    assert short_label(label) == short


def test_the_plain_decoding_of_a_llamacpp_run_is_named_for_it() -> None:
    from leapdecode.bench.labels import run_backend, short_label

    assert short_label("ar", "llama.cpp") == "llama.cpp plain" and short_label("ar@torch", "llama.cpp") == "ar@torch"
    assert short_label("llama-cpp", "llama.cpp") == "llama-cpp"  # llama-cpp-python's own generator, a peer
    assert run_backend({"backend": "llama.cpp"}) == run_backend({"weights": "llama.cpp gguf"}) == "llama.cpp"
    assert run_backend({}) == "torch"


@pytest.mark.parametrize("cls", METHODS, ids=[m.name for m in METHODS])
def test_a_short_label_names_the_same_method(cls) -> None:
    """Parsing a short label gives its method back: entries with different strings keep different labels."""
    import dataclasses

    from leapdecode.bench.labels import short_label, short_method
    from leapdecode.methods import parse_method

    required = {
        "rest": "datastore=ds",
        "layerskip": "exit=2",
        "hf-assisted": "model=m",
        "draft": "model=m",
        "llama-cpp-spec": "model=m",
    }
    method = parse_method(f"{cls.name}:{required[cls.name]}" if cls.name in required else cls.name)
    assert parse_method(short_method(method)) == method
    length = length_parameter(method) or next((f.name for f in dataclasses.fields(cls) if f.type in (int, "int")), "")
    if length:
        other = dataclasses.replace(method, **{length: getattr(method, length) + 1})
        assert short_label(str(other)) != short_label(str(method)) and parse_method(short_label(str(other))) == other


def test_peers_that_differ_are_listed_apart_and_do_not_fail_the_check() -> None:
    samples = [
        sample("ar", "a", "qa", 2.0),
        sample("anpd", "a", "qa", 1.0, equal=True),
        sample("hf", "a", "qa", 2.5, equal=False, diff=7),
        sample("hf-pld:tokens=5,max_ngram=2", "a", "qa", 2.0, equal=True),
        sample("llama-cpp@llama.cpp", "a", "qa", 2.0, equal=False, diff=3),
        sample("calm:threshold=0.9", "a", "qa", 1.0, equal=False, diff=2, lossless=False),
    ]
    text = report.mismatch_report(samples)
    assert text.startswith("Lossless check: all 1 samples equal plain decoding")
    assert "FAILED" not in text
    assert "Peers that differ from plain decoding: 2 of 3 samples" in text
    assert "| `hf` | a | qa | 7 |" in text and "| `llama-cpp@llama.cpp` | a | qa | 3 |" in text
    assert "Lossy methods: 1 of 1 samples differ" in text
    assert report.lossless_failures(samples) == []
    # what `leapdecode bench` exits 1 on: a lossless method of this engine among the mismatches
    assert not any(s.lossless for s in report.mismatches(samples))
    assert [s.method for s in report.peer_differences(samples)] == ["hf", "llama-cpp@llama.cpp"]
    broken = [*samples, sample("pld", "a", "qa", 1.0, equal=False, diff=5)]
    text = report.mismatch_report(broken)
    assert (
        "**Lossless check FAILED: 1 of 2 samples differ from plain decoding.**" in text
        and "| `pld` | a | qa | 5 |" in text
    )
    assert "Peers that differ" in text and [s.method for s in report.lossless_failures(broken)] == ["pld"]
    assert any(s.lossless for s in report.mismatches(broken))
    table = report.markdown_table(broken)
    assert "| 0/1 | – |" in next(
        line for line in table.splitlines() if line.startswith("| `hf` |")
    )  # a peer: not flagged
    assert "**0/1**" in next(line for line in table.splitlines() if line.startswith("| `pld` |"))


def test_summary_records_when_where_and_from_what_a_run_came(tmp_path, samples) -> None:
    import leapdecode
    from leapdecode.bench.harness import run_meta

    meta = run_meta("m", "humaneval", "3", 8, 2, 3, "torch int4 row-exact")
    paths = report.write_outputs(tmp_path, samples, meta, {"anpd:n=5,k=7": 7})
    recorded = json.loads(paths["summary"].read_text())["meta"]
    assert {"date", "commit", "version", "machine", "threads", "weights"} <= set(recorded)
    assert recorded["date"].endswith("+00:00") and recorded["version"] == leapdecode.__version__
    assert recorded["threads"] == 2 and recorded["weights"] == "torch int4 row-exact"
    assert "cores" in recorded["machine"] and "torch" in recorded["machine"]
    commit = recorded["commit"]
    assert commit is None or len(commit.removesuffix("-dirty")) >= 4
    header = paths["table"].read_text().split("\n\n")[0]
    assert (
        recorded["date"] in header
        and f"leapdecode {recorded['version']}" in header
        and "(torch int4 row-exact)" in header
    )
    assert all(
        r["label"] == "anpd"
        for r in json.loads(paths["summary"].read_text())["results"]
        if r["method"] == "anpd:n=5,k=7"
    )


def test_the_commit_is_marked_dirty_when_tracked_files_changed(tmp_path, monkeypatch) -> None:
    import subprocess

    from leapdecode.bench import harness

    answers = {
        "--show-toplevel": str(harness.Path(harness.leapdecode.__file__).resolve().parent.parent),
        "--short": "abc1234",
        "--porcelain": " M leapdecode/x.py",
    }

    def fake_run(args, **kwargs):
        out = next((v for k, v in answers.items() if k in args), "")
        return subprocess.CompletedProcess(args, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    assert harness.source_commit() == "abc1234-dirty"
    answers["--porcelain"] = ""
    assert harness.source_commit() == "abc1234"
    answers["--show-toplevel"] = str(tmp_path)  # a checkout of something else around an installed package
    assert harness.source_commit() is None


def _write_old_run(folder, samples) -> None:
    """A run as an older version wrote it: full method strings, no date, commit or version."""
    folder.mkdir()
    (folder / "samples.jsonl").write_text("".join(json.dumps(s.to_dict()) + "\n" for s in samples))
    meta = {
        "model": "m",
        "weights": "torch float32",
        "dataset": "d",
        "limit": "1",
        "max_new_tokens": 8,
        "threads": 2,
        "prompts": 2,
        "machine": "cpu, 2 cores, no GPU, torch 2, 2 threads",
        "backend": "torch",
    }
    (folder / "summary.json").write_text(json.dumps({"meta": meta, "results": []}))


def test_report_re_renders_an_old_run_with_the_current_labels(tmp_path) -> None:
    from typer.testing import CliRunner

    from leapdecode.cli import app

    samples = [
        sample("ar", "a", "qa", 2.0),
        sample("ar", "b", "humaneval", 4.0),
        sample("anpd:n=5,k=7,cost_aware=True", "a", "qa", 1.0, passes=5, drafted=14, accepted=5, equal=True),
        sample("anpd:n=5,k=7,cost_aware=True", "b", "humaneval", 2.0, passes=4, drafted=14, accepted=6, equal=True),
        sample("hf", "a", "qa", 2.0, equal=False, diff=4),
        sample("hf", "b", "humaneval", 4.0, equal=True),
    ]
    run = tmp_path / "run"
    _write_old_run(run, samples)
    again = tmp_path / "again"
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(again)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    table = (again / "results.md").read_text()
    assert "| `anpd` |" in table and "cost_aware" not in table
    assert (
        "Lossless check: all 2 samples equal plain decoding" in table
        and "Peers that differ from plain decoding: 1 of 2" in table
    )
    meta = json.loads((again / "summary.json").read_text())["meta"]
    assert "date" not in meta and "commit" not in meta  # not invented
    assert (again / "speedup_by_category.png").stat().st_size > 0 and (
        again / "accepted_lengths.png"
    ).stat().st_size > 0
    assert [json.loads(line)["method"] for line in (again / "samples.jsonl").read_text().splitlines()] == [
        s.method for s in samples
    ]
    assert not (run / "results.md").exists()  # --out leaves the run's folder as it was

    result = CliRunner().invoke(app, ["report", str(run), "--date", "2025-05-06T07:08:09+00:00", "--commit", "0ba77a7"])
    assert result.exit_code == 0, result.output
    meta = json.loads((run / "summary.json").read_text())["meta"]
    assert meta["date"] == "2025-05-06T07:08:09+00:00" and meta["commit"] == "0ba77a7"
    assert "Run 2025-05-06T07:08:09+00:00, commit 0ba77a7." in (run / "results.md").read_text()


def test_llama_cpps_speculative_report_is_read_and_a_missing_one_is_an_error() -> None:
    from leapdecode.bench.llamacpp_tools import parse_speculative
    from leapdecode.errors import MethodError

    log = """encoded   42 tokens in    0.250 seconds, speed:  168.000 t/s
decoded  130 tokens in    4.750 seconds, speed:   27.368 t/s

n_draft   = 3
n_predict = 130
n_drafted = 96
n_accept  = 70
accept    = 72.917%
"""
    assert parse_speculative(log) == (5.0, 130, 96, 70)
    with pytest.raises(MethodError, match="gave no report"):
        parse_speculative("error: failed to load model")


def test_bench_threads_default_to_all_cores_or_the_environments_omp_num_threads(monkeypatch) -> None:
    import os

    import torch

    from leapdecode.bench.harness import use_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert use_threads(0) == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert use_threads(0) == (os.cpu_count() or 1)
        assert use_threads(1) == 1
        with pytest.raises(InputError, match="--threads must be >= 0"):
            use_threads(-1)
        assert torch.get_num_threads() == 1  # a refused value changes nothing
    finally:
        torch.set_num_threads(before)


def test_the_concurrency_table_names_methods_short_and_counts_cached_prompt_tokens() -> None:
    from leapdecode.bench.concurrent import concurrency_table
    from leapdecode.bench.concurrent_result import SOLO, ConcurrentResult

    long = "draft:model=m,k=5,schedule=constant,threshold=0.0,coupled=True,window=128"
    rows = [
        ConcurrentResult(long, SOLO, 4, 40, 10.0, prompt_tokens=400, identical=4),
        ConcurrentResult(long, "4", 4, 40, 4.0, prompt_tokens=400, cached_tokens=270, identical=4),
        ConcurrentResult("llama-server", SOLO, 4, 40, 20.0, prompt_tokens=400, identical=3, peer=True),
        ConcurrentResult("llama-server", "4", 4, 40, 10.0, prompt_tokens=400, cached_tokens=90, identical=3, peer=True),
    ]
    table = concurrency_table(rows).splitlines()
    assert "prompt tokens cached" in table[0] and long not in "\n".join(table)
    assert table[3].startswith("| draft:model=m | 4 | 10.0 | 2.50x |") and "| 270/400 | 4/4 |" in table[3]
    assert table[5].startswith("| llama-server | 4 | 4.0 | 2.00x |") and "| 90/400 | 3/4 |" in table[5]
