"""bench/RESULTS.md keeps the latest section per benchmark: a rerun replaces its own section (and
any duplicates of it), leaves the others, and a new benchmark is appended."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from report import replace_section  # noqa: E402

TEXT = ("# Results\n\nintro\n\n### ROS path — 2026-11-30\n\nold\n\n### Speech — 2026-11-30\n\nspeech\n\n"
        "### ROS path — 2026-11-30\n\nolder duplicate\n")


def test_a_rerun_replaces_its_own_section_and_its_duplicates():
    out = replace_section(TEXT, "### ROS path — 2026-12-01\n\nnew\n")
    assert out.count("### ROS path") == 1 and "new" in out and "old" not in out
    assert out.index("### ROS path") < out.index("### Speech") and "speech" in out and out.startswith("# Results")


def test_a_new_benchmark_is_appended():
    out = replace_section(TEXT, "### Roofline — 2026-12-01\n\nrows\n")
    assert out.rstrip().endswith("rows") and out.count("### ROS path") == 2
