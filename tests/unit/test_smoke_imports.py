import subprocess
import sys

import pytest


@pytest.mark.integration  # a fresh interpreter
def test_import_multigpu_does_not_import_torch() -> None:
    code = "import multigpu, multigpu.cli.main, multigpu.rank.bootstrap, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.integration  # a fresh interpreter
def test_import_multigpu_hides_torchs_numpy_warning_and_only_it() -> None:
    """Every process of a run (launcher, template, ranks) imports multigpu before torch: the filter
    there is what keeps torch's "Failed to initialize NumPy" off every first screen."""
    code = (
        "import multigpu, warnings\n"
        "warnings.warn(\"Failed to initialize NumPy: No module named 'numpy' (Triggered internally)\")\n"
        "warnings.warn('Failed to initialize NumPy: _ARRAY_API not found')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "No module named" not in out.stderr and "_ARRAY_API not found" in out.stderr, out.stderr


def test_every_name_the_package_exports_resolves() -> None:
    """``multigpu.NAME`` for each name of ``__all__``: the facade's lazy table names modules that exist."""
    import multigpu

    broken = []
    for name in multigpu.__all__:
        try:
            getattr(multigpu, name)
        except (AttributeError, ImportError) as exc:
            broken.append(f"{name}: {exc}")
    assert not broken, broken
