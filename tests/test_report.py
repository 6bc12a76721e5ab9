"""`farm report` and the result tables as a user meets them: a plain profiling job gives a page
worth opening (results table, plots that are not blank, a browser renders it), hostile names stay
text, failed jobs say why there is nothing to plot, and tables keep every model name whole."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from browser import install_chromium
from conftest import write_job
from farm.controller.analysis import plots
from farm.controller.analysis.report import ops_section
from farm.controller.analysis.results import AveragedRecord, average_repeats, run_records
from run_records import run_record

from farm.proto.questions import RunRecord
from farm.controller.store import SQLiteStore as Store
from farm.controller.store.rows import TelemetrySampleRow

HOSTILE = "<script>alert(1)</script>$x_{1}$&\"'\x1b[31m"
LONG = "mobilenetv2_w0.35_r96_a_model_name_long_enough_to_be_cut"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # browser.install_chromium() installs it as root


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from farm.model_generators.generate import generate_examples
    d = tmp_path_factory.mktemp("report-models")
    generate_examples(d, widths=[0.35, 0.5], input_sizes=[96, 128], formats=("tflite",), zoo=False)
    return d


def _job(models: Path, name: str, body: str) -> Path:
    return write_job(models, f"name: {name}\n{body}\nworkload: {{type: benchmark, iterations: 10, warmup: 1}}\n"
                             "sim: {memory: 1g}\n", f"{name}.yaml")


def _png_check(data: bytes, min_size: tuple[int, int] = (300, 200)) -> Image.Image:
    """A real PNG of a useful size whose pixels are not all one colour."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data)).convert("L")
    assert image.size[0] >= min_size[0] and image.size[1] >= min_size[1], image.size
    stat = ImageStat.Stat(image)
    assert stat.stddev[0] > 5, "blank image"
    assert sum(1 for n in image.histogram() if n) > 20  # lines, text, axes: many shades, not a flat fill
    return image


def test_plain_job_report_has_the_table_and_plots_and_renders_in_a_browser(models: Path, farm, tmp_path: Path) -> None:
    job = _job(models, "plain", "models: [mobilenetv2_w0.35_r96.tflite, mobilenetv2_w0.5_r96.tflite]\nrepeats: 2")
    assert farm("submit", str(job), "--quiet").returncode == 0
    page_path, png_dir = tmp_path / "report.html", tmp_path / "png"
    made = farm("report", "1", "-o", str(page_path), "--png", str(png_dir), "--json")
    assert made.returncode == 0, made.stderr
    assert not [w for w in made.json()["warnings"] if "contended" not in w]  # a busy machine may contend a run
    # progress while it renders: a line per figure on stderr, with the seconds since the start
    assert re.search(r"report +\d+\.\d s  overview figure", made.stderr) and "telemetry figure" in made.stderr
    page = page_path.read_text()

    # the results table comes first, with units, one averaged row per model; the spec is last and folded
    assert page.index("<h2 id=results>") < page.index("<h2 id=sweeps>") < page.index("<h2 id=spec>")
    table = page[page.index("<table class='results'>"):page.index("</table>", page.index("<table class='results'>"))]
    for header in ("latency avg ± sd (ms)", "peak memory (MB)", "throughput (inf/s)", "runs (ok/all)", "budget (cores · MB)"):
        assert header in table
    assert table.count("<tr>") == 1 + 2 and table.count(">2/2") == 2  # (", 1 contended" on a busy machine)
    assert page.rstrip().endswith("</pre></details>\n</body></html>")
    assert page.index("<pre>name: plain\n") > page.index("<details><summary>the job as submitted (YAML")

    # self-contained: nothing fetched from anywhere, no script
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", page) and "<script" not in page

    # every figure is in the page and in the folder, of a useful size and not blank
    embedded = [base64.b64decode(m) for m in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)]
    written = sorted(png_dir.glob("*.png"))
    assert {p.name for p in written} >= {"overview.png"} and any(p.name.startswith("telemetry-") for p in written)
    assert len(embedded) == len(written) >= 3
    for data in [*embedded, *(p.read_bytes() for p in written)]:
        _png_check(data)

    # a real browser draws it: the screenshot is not blank
    if not install_chromium():
        pytest.skip("chromium is not installed and cannot be here (apt-get install -y chromium; needs root)")
    shot = tmp_path / "shot.png"
    run = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                          "--window-size=1280,900", page_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.exists(), run.stderr[-2000:]
    image = _png_check(shot.read_bytes(), (1280, 900))
    top = image.crop((0, 0, 1280, 300))  # the title and the results table are on the first screen
    assert ImageStat.Stat(top).stddev[0] > 5


def test_sweep_plots_per_family_against_threads_and_input_size(models: Path, farm, tmp_path: Path) -> None:
    job = _job(models, "sweep", "models: [mobilenetv2_w0.35_r96.tflite, mobilenetv2_w0.35_r128.tflite]\n"
                                "matrix: {threads: [1, 2]}")
    assert farm("submit", str(job), "--quiet").returncode == 0
    png_dir = tmp_path / "png"
    assert farm("report", "1", "--png", str(png_dir)).returncode == 0
    names = {p.name for p in png_dir.glob("*.png")}
    # one family (the name without its input size): a figure against threads, one against input size;
    # the CPU budget follows threads (the default), so it gets no figure of its own
    assert {"sweep-mobilenetv2_w0.35-threads.png", "sweep-mobilenetv2_w0.35-input_size.png"} <= names
    assert not any("cpus" in n for n in names)
    for name in names:
        _png_check((png_dir / name).read_bytes())
    store = Store(tmp_path / "farm.db")
    averaged = [r for r in average_repeats(run_records(store, 1))]
    swept = [p.key for p in plots.swept_params(averaged)]
    assert swept == ["threads", "input_size"]


def test_hostile_model_names_stay_text(models: Path, farm, tmp_path: Path) -> None:
    quoted = HOSTILE.replace('"', '\\"').replace("\x1b", "\\e")  # YAML's escape for ESC
    job = write_job(models, f"""name: "{quoted}"
models:
  - path: mobilenetv2_w0.35_r96.tflite
    name: "{quoted}"
    family: "{quoted}"
workload: {{type: benchmark, iterations: 5, warmup: 1}}
matrix: {{threads: [1, 2]}}
sim: {{memory: 1g}}
""", "hostile.yaml")
    assert farm("submit", str(job), "--quiet").returncode == 0, "submit"
    page_path, png_dir = tmp_path / "r.html", tmp_path / "png"
    made = farm("report", "1", "-o", str(page_path), "--png", str(png_dir))
    assert made.returncode == 0, made.stderr
    page = page_path.read_text()
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "\x1b" not in page and "\\x1b[31m" in page  # a terminal escape is shown, not kept
    shown = farm("results", "1", "--wide").stdout
    assert "\x1b" not in shown and "<script>alert(1)</script>$x_{1}$" in shown
    for p in png_dir.iterdir():  # file names from hostile strings are safe names in the folder
        assert re.fullmatch(r"[A-Za-z0-9._-]+\.png", p.name), p.name
        _png_check(p.read_bytes())


def test_a_job_with_no_completed_run_warns_and_makes_no_empty_folder(tiny_models, farm, tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text("import sys\nsys.exit('<b>broken</b> on purpose')\n")
    job = write_job(tmp_path, f"""name: broken
models: [{tiny_models['tflite']}]
workload: {{type: script, command: python, script: fail.py, dir: .}}
sim: {{memory: 1g}}
""")
    assert farm("submit", str(job), "--quiet").returncode == 1
    png_dir = tmp_path / "png"
    made = farm("report", "1", "-o", str(tmp_path / "r.html"), "--png", str(png_dir))
    assert made.returncode == 0, made.stderr
    assert "warning" in made.stderr and "no completed run" in made.stderr and not png_dir.exists()
    page = (tmp_path / "r.html").read_text()
    assert "has no completed run" in page and "1 failed run(s)" in page and "&lt;b&gt;broken" in page


def test_operator_profiles_render_when_runs_carry_them() -> None:
    fields = {"model": {"name": "m<b>"}, "target": "sim", "threads": 1, "batch_size": 1, "input_size": None, "repeat": 0}
    record = run_record(**fields, op_profile=[{"op": "CONV_2D", "count": 3, "avg_ms": 0.5, "pct": 60.0},
                                              {"op": "<img src=x>", "count": 1, "avg_ms": 0.1, "pct": 40.0},
                                              {"op": None, "count": "x"}, "not a dict"])
    html = ops_section([record, run_record(**fields)])
    assert "CONV_2D" in html and "&lt;img src=x&gt;" in html and "<img" not in html and "m&lt;b&gt;" in html
    assert html.index("CONV_2D") < html.index("&lt;img")  # the biggest share first
    assert ops_section([run_record(**fields)]) == ""


def test_calibration_scatter_labels_never_overlap() -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    xs = [1.0, 1.01, 1.02, 1.03, 5.0, 9.0]
    ys = [1.0, 1.0, 1.01, 1.02, 5.0, 9.0]
    ax.scatter(xs, ys)
    texts = plots.place_labels(ax, zip(xs, ys), [f"mobilenetv2_w{i}_r224" for i in range(len(xs))])
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in texts]
    assert len(texts) >= 4  # the lone points and some of the cluster
    assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_tables_keep_model_names_whole(models: Path, farm, tmp_path: Path, columns: int) -> None:
    (models / f"{LONG}.tflite").write_bytes((models / "mobilenetv2_w0.35_r96.tflite").read_bytes())
    job = _job(models, f"wide{columns}", f"models: [{LONG}.tflite, mobilenetv2_w0.5_r128.tflite]\nrepeats: 2")
    env = {"COLUMNS": str(columns)}
    empty = farm("jobs", env=env)
    said = " ".join(empty.stdout.split())
    assert empty.returncode == 0 and "no jobs in this store yet" in said and "farm submit" in said
    assert farm("submit", str(job), "--quiet", env=env).returncode == 0
    shown = farm("results", "1", env=env).stdout
    assert LONG in shown and "mobilenetv2_w0.5_r128" in shown
    assert max(len(line) for line in shown.splitlines()) <= columns
    assert "…" not in shown  # no figure cut either: a long name gets a line of its own instead
    rows = [line for line in shown.splitlines() if LONG in line]
    assert len(rows) == 1  # repeats averaged into one row
    per_run = farm("results", "1", "--runs", env=env).stdout
    # a latency figure (avg ± sd) per run, whatever its size: a busy machine's run may take more than 1 ms
    assert "rep" in per_run and "…" not in per_run and len(re.findall(r"\b\d[\d.e+]* ± \d[\d.e+]*", per_run)) == 4
    wide = farm("results", "1", "--wide", "--runs", env=env).stdout
    assert LONG in wide and "backend" in wide and "p90 ms" in wide and ("cgroup" in wide or "process" in wide)
    jobs = farm("jobs", env=env).stdout
    assert f"wide{columns}" in jobs
    pairs = farm("results", "1", "--pairs", env=env).stdout
    assert "no completed pairs" in pairs and "targets: [NAME]" in " ".join(pairs.split())


def test_empty_lists_say_what_to_do(farm) -> None:
    for command, hint in ((["calibrations"], "farm calibrate --sim-job"), (["device", "health"], "farm refresh"),
                          (["drift"], "farm refresh"), (["jobs"], "farm submit examples/quickstart.yaml")):
        run = farm(*command, env={"COLUMNS": "100"})
        assert run.returncode == 0, run.stderr
        assert hint in " ".join(run.stdout.split()) and "┃" not in run.stdout, command  # a sentence, not bare headers


def test_a_job_of_many_models_keeps_the_overview_readable() -> None:
    records = [run_record(model={"name": f"model_{i}", "family": None}, threads=1, batch_size=1, input_size=None,
                          target="sim", latency_ms={"avg": 1.0 + i, "std": 0.1}, peak_memory_mb=10.0 + i)
               for i in range(500)]
    fig = plots.overview_figure(records)
    image = _png_check(fig.png)
    assert image.size[1] <= (0.28 * plots.MAX_BARS + 1.2) * plots.DPI + 1  # 60 bars, not 500


def test_the_cpu_budget_gets_its_own_plot_only_when_swept_apart_from_threads() -> None:
    def record(threads: int, cpus: float, name: str = "mobilenetv2_w0.5_r160") -> RunRecord:
        return run_record(model={"name": name, "family": None}, threads=threads, batch_size=1, input_size=None,
                          target="sim", limits={"cpus": cpus}, latency_ms={"avg": 10 / cpus, "std": 0.1},
                          peak_memory_mb=20.0)
    follows = [record(1, 1.0), record(2, 2.0)]  # the default: the budget is the thread count
    assert [p.key for p in plots.swept_params(follows)] == ["threads"]
    apart = [record(1, 0.5), record(1, 1.0), record(2, 1.0), record(2, 2.0)]  # matrix.cpus beside threads
    assert [p.key for p in plots.swept_params(apart)] == ["threads", "cpus"]
    cpus = next(p for p in plots.swept_params(apart) if p.key == "cpus")
    threads = next(p for p in plots.swept_params(apart) if p.key == "threads")
    fig = plots.sweep_figure("mobilenetv2_w0.5", apart, cpus, [threads])  # a line per thread count
    assert fig is not None and fig.name == "sweep-mobilenetv2_w0.5-cpus.png"
    _png_check(fig.png)
    assert plots.family_of(apart[0]) == "mobilenetv2_w0.5" and plots.input_size_of(apart[0]) == 160


def test_csv_keeps_formula_like_names_as_text() -> None:
    # a job file names its models: a spreadsheet must not run one called like a formula
    import csv
    import io

    from farm.cli.render import results_csv
    records = [run_record(model={"name": "=HYPERLINK(\"http://x\")"}, target="@sim", threads=1, latency_ms={"avg": -1.5})]
    row = next(csv.DictReader(io.StringIO(results_csv(records))))
    assert row["model.name"] == "'=HYPERLINK(\"http://x\")" and row["target"] == "'@sim"
    assert row["latency_ms.avg"] == "-1.5"  # numbers stay numbers


def _device_records(script: bool = False) -> list[AveragedRecord]:
    """Averaged records of a device experiment: a family of three models, the sim and two phones, 1/2/4 threads."""
    records = []
    for i, name in enumerate(("m_small", "m_mid", "m_big")):
        for target in ("sim", "g6-1", "s8-1"):
            for threads in (1, 2, 4):
                scale = (1.0 if target == "sim" else 3.5) * (i + 1) / threads
                records.append(AveragedRecord.of_run(run_record(
                    model={"name": name, "family": "fam"}, target=target, threads=threads, batch_size=1,
                    input_size=None, status="completed", limits={"cpus": float(threads)} if target == "sim" else None,
                    latency_ms=None if script else {"avg": 10 * scale, "std": 0.1},
                    whole_run_s=2 * scale if script else None, wall_s=2 * scale, peak_memory_mb=50.0 + 10 * i,
                    avg_memory_mb=40.0 + 10 * i), completed=1))
    return records


def test_a_device_experiment_gets_one_figure_per_family_with_every_target_and_thread_count() -> None:
    from farm.controller.analysis.report import sweep_section

    records = _device_records()
    # device runs have no CPU budget imposed: the sim's budget still follows threads, so no cpus figure
    assert [p.key for p in plots.swept_params(records)] == ["threads"]
    figures: list = []
    html = sweep_section(records, figures)
    names = [f.name for f in figures]
    assert names == ["family-fam.png", "overview.png"], names  # not a sweep figure per family and target
    assert "fam on every target and thread count" in html
    _png_check(figures[0].png, (900, 400))
    # benchmark: latency and peak memory; script (the Jetson experiment): whole run, peak and average memory
    assert [p[0] for p in plots.family_panels(records)] == ["latency", "peak_memory"]
    assert [p[0] for p in plots.family_panels(_device_records(script=True))] == ["whole_run", "peak_memory",
                                                                                   "avg_memory"]
    # a sim-only sweep keeps its figure against threads
    sim_only: list = []
    sweep_section([r for r in records if r.target == "sim"], sim_only)
    assert "sweep-fam-threads.png" in [f.name for f in sim_only]


def test_telemetry_lines_stop_at_gaps() -> None:
    ts = [0.0, 0.1, 0.2, 0.3, 2.0, 2.1, 2.2, None, 2.3]
    values = [1.0, 2.0, 3.0, 4.0, 9.0, 9.0, 9.0, 5.0, 9.0]
    xs, ys = plots.break_gaps(ts, values)
    nan_at = [i for i, y in enumerate(ys) if y != y]
    assert len(nan_at) == 1 and xs[nan_at[0] - 1] == 0.3 and xs[nan_at[0] + 1] == 2.0  # one break, in the gap
    assert [y for y in ys if y == y] == [1.0, 2.0, 3.0, 4.0, 9.0, 9.0, 9.0, 9.0]  # no sample lost (bar the timeless)
    assert all(y == y for y in plots.break_gaps([0.0, 0.1, 0.2, 0.31, 0.4], [1.0] * 5)[1])  # jitter is no gap
    assert plots.break_gaps([], []) == ([], [])
    samples = [TelemetrySampleRow(t_s=t, memory_bytes=int(1e6 * v), cpu_percent=50.0)
               for t, v in zip(ts, values) if t is not None]
    fig = plots.telemetry_figure("m", [("t1", samples)])
    assert fig is not None
    _png_check(fig.png)


def test_a_script_job_leads_with_whole_run_time() -> None:
    """Auptimizer users run scripts: the whole-run time comes before latency (which a script may not report)."""
    from rich.console import Console

    from farm.cli.render import results_table
    from farm.controller.analysis.report import results_section

    def table(records: list[RunRecord]) -> list[str]:
        console = Console(width=200, record=True)
        console.print(results_table(records, runs=True))
        return console.export_text().splitlines()

    def record(whole_run: float | None, latency: dict | None) -> AveragedRecord:
        return AveragedRecord.of_run(run_record(
            model={"name": "m", "family": None}, target="sim", threads=1, batch_size=1, input_size=None, repeat=0,
            status="completed", failure_class=None, message="", limits={"cpus": 1.0, "memory_mb": 1024.0},
            latency_ms=latency, whole_run_s=whole_run, wall_s=2.5, peak_memory_mb=50.0, avg_memory_mb=40.0,
            cpu_percent={"avg": 90.0, "peak": 100.0}, backend="cgroup", contention=None), runs=1, completed=1)

    script = table([record(2.125, None)])
    header = next(line for line in script if "whole run" in line)
    assert header.index("whole run") < header.index("latency") and "2.125" in "\n".join(script)
    benchmark = table([record(None, {"avg": 3.0, "std": 0.1})])
    assert not any("whole run" in line for line in benchmark)  # a benchmark leads with latency, as before
    page = results_section([record(2.125, None)])
    assert page.index("whole run (s)") < page.index("latency avg") and ">2.12<" in page
    assert "whole run (s)" not in results_section([record(None, {"avg": 3.0, "std": 0.1})])


def test_calibrations_of_a_family_share_one_figure_and_many_devices_split_it(tmp_path: Path) -> None:
    """Two metrics × two devices × three thread counts: one figure of four panels, not 24 PNGs;
    a lab of many devices gets a figure per few devices rather than one unreadable grid."""
    from farm.controller.analysis import report
    from farm.controller.analysis.calibration import Pair, calibrate
    from farm.controller.analysis.calibrations import CalibrationSource, StoredCalibration

    def stored(device: str, metric: str, threads: int, r2_nan: bool = False) -> StoredCalibration:
        pairs = [Pair(f"m{i}", float(i + 1), 5.0 if r2_nan else 3.0 * (i + 1) / threads + 0.1 * (i % 2))
                 for i in range(6)]
        return StoredCalibration(1, device, metric, threads, "tflite", "", 1, calibrate(pairs), CalibrationSource(job=1))

    group = [stored(d, m, t) for d in ("g6-1", "s8-1") for m in ("latency", "peak_memory") for t in (1, 2, 4)]
    store = Store(tmp_path / "farm.db")
    figures: list = []
    html = report.calibrations_section(store, group, figures)
    assert len(figures) == 1 and figures[0].name.startswith("calibrations-every_model")
    image = _png_check(figures[0].png, (1000, 800))  # a 2 × 2 grid of panels
    assert image.size == (2 * 520, 2 * 440)
    assert html.count("<section>") == 12 and html.count("<img") == 1
    many = [stored(f"phone-{i}", "latency", 1) for i in range(12)] + [stored("flat", "latency", 1, r2_nan=True)]
    figures = []
    report.calibrations_section(store, many, figures)
    assert len(figures) == 2 and all("devices" in f.name for f in figures)  # 13 devices, 12 panels a figure
