"""bench/provenance.py: every figure names the machine and the day of its run (issue 33 item 5)."""

from pdserve.bench.experiments import report
from pdserve.bench.provenance import machine, save_figure, stamp

RUN = {"cpu_model": "AMD EPYC", "cpus": 2, "utc": "2026-11-29T04:10:00Z", "git_commit": "abc1234"}


def test_the_stamp_names_cpu_day_and_commit_and_leaves_out_what_is_missing():
    assert stamp(RUN) == "AMD EPYC (2 CPUs) · 2026-11-29 · commit abc1234"
    assert stamp({"utc": "2026-11-29T04:10:00Z"}) == "CPU not recorded · 2026-11-29"
    here = machine()
    assert here["utc"][:10] in stamp(here) and str(here["cpus"]) in stamp(here)


def test_a_saved_figure_carries_the_runs_stamp_not_the_drawing_machines(tmp_path):
    plt = report.pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    path = save_figure(fig, tmp_path / "sub" / "f.png", record=RUN)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [t.get_text() for t in fig.texts] == [stamp(RUN)]


def test_without_a_record_the_stamp_is_this_machine_now(tmp_path):
    plt = report.pyplot()
    fig, _ = plt.subplots()
    save_figure(fig, tmp_path / "f.png")
    (text,) = [t.get_text() for t in fig.texts]
    assert text.startswith(machine()["cpu_model"] or "CPU not recorded") and machine()["utc"][:10] in text
