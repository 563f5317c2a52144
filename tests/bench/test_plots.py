"""blink.bench.plots without matplotlib (the bench extra not installed): an ImportError that names the extra."""
import sys

import pytest

from blink.bench.plots import write_plots


def test_without_matplotlib_plots_name_the_bench_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # `import matplotlib` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'blink-serve\[bench\]'"):
        write_plots([], tmp_path / "img")
    assert not (tmp_path / "img").exists()
