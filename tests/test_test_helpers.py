"""The tests' own helpers: a subprocess past its time fails with a message that says what to do."""

from __future__ import annotations

import sys

import pytest

from helpers import TIMEOUT_SCALE_ENV, run_command


def test_a_subprocess_past_its_time_fails_saying_what_ran_and_how_to_allow_more(monkeypatch):
    monkeypatch.delenv(TIMEOUT_SCALE_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception) as failed:
        run_command([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], timeout=2)
    message = str(failed.value)
    assert "did not finish in 2 s" in message and "load average" in message
    assert f"{TIMEOUT_SCALE_ENV}=2" in message and "started" in message


def test_the_scale_gives_more_time(monkeypatch):
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "40")
    result = run_command([sys.executable, "-c", "import time; time.sleep(0.3); print('done')"], timeout=0.05)
    assert result.returncode == 0 and result.stdout.strip() == "done"
