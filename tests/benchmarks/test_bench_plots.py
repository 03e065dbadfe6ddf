"""The benchmark figures read correctly: no value label collides with another, leaves its
axes or hides under the legend (bench_codec.png), and each method keeps one name and one
colour across both panels (bench_train.png).

The figures are drawn from the committed results and from small made-up ones (the short
bars a ``--quick`` run gives), without running a benchmark.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("matplotlib")

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.fixture
def bench() -> Iterator[Any]:
    """``bench(name)``: the benchmark module ``benchmarks/<name>.py``, imported."""
    folder = str(RESULTS.parent)
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(folder)


def drawn(module: ModuleType, res: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The figure ``module.plot(res, ...)`` draws, rendered, instead of saved."""
    figures: list[Any] = []
    monkeypatch.setattr(module, "savefig", lambda fig, path: figures.append(fig))
    module.plot(res, "unused.png")
    (fig,) = figures
    fig.canvas.draw()
    return fig


def value_labels(ax: Any) -> list[Any]:
    """The numbers written on an axes' bars (every annotation or text that parses as one)."""
    labels = []
    for text in ax.texts:
        try:
            float(text.get_text())
        except ValueError:
            continue
        labels.append(text)
    return labels


def codec_results(small: bool) -> dict[str, Any]:
    res: dict[str, Any] = json.loads((RESULTS / "bench_codec.json").read_text())
    if small:  # a quick run's figures: bars barely above the axis, one zero speed
        res = copy.deepcopy(res)
        for entry in res["results"].values():
            entry["asyncckpt_file_fraction"] = 0.51
            speeds = entry["throughput_gb_s"]
            for i, key in enumerate(speeds):
                speeds[key] = 0.0 if i == 0 else 0.01 * i
    return res


@pytest.mark.parametrize("small", [False, True], ids=["committed", "quick-like"])
def test_codec_value_labels_do_not_collide(
    bench: Any, monkeypatch: pytest.MonkeyPatch, small: bool
) -> None:
    fig = drawn(bench("bench_codec"), codec_results(small), monkeypatch)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = value_labels(ax)
        assert labels, ax.get_title()
        boxes = [t.get_window_extent(renderer) for t in labels]
        inside = ax.get_window_extent(renderer)
        legend = ax.get_legend().get_window_extent(renderer)
        for text, box in zip(labels, boxes):
            where = f"{ax.get_title()}: label {text.get_text()!r}"
            assert inside.x0 <= box.x0 and box.x1 <= inside.x1, where
            assert inside.y0 <= box.y0 and box.y1 <= inside.y1, where
            assert not box.overlaps(legend), f"{where} under the legend"
        for i, a in enumerate(boxes):
            for j in range(i + 1, len(boxes)):
                assert not a.overlaps(boxes[j]), (labels[i].get_text(), labels[j].get_text())


def test_train_bars_name_and_colour_each_method_as_the_legend_does(
    bench: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = bench("bench_train")
    res = json.loads((RESULTS / "bench_train.json").read_text())
    fig = drawn(module, res, monkeypatch)
    lines, bars = fig.axes
    colour = {
        line.get_label(): line.get_color()
        for line in lines.get_lines()
        if not line.get_label().startswith("_")
    }
    assert set(colour) == {e["label"] for e in res["modes"].values()}
    ticks = [t.get_text() for t in bars.get_xticklabels()]
    labels = [res["modes"][m]["label"] for m in res["modes"] if m != "none"]
    assert ticks == [module._wrap(label) for label in labels]
    from matplotlib.colors import to_rgb

    for x, label in enumerate(labels):  # every bar above a method's tick has its colour
        over = [p for p in bars.patches if abs(p.get_x() + p.get_width() / 2 - x) < 0.5]
        assert len(over) == 2, label
        for patch in over:
            assert to_rgb(patch.get_facecolor()) == to_rgb(colour[label]), label
    for entry in bars.get_legend().get_texts():  # the bar legend names statistics only
        assert entry.get_text() not in colour
