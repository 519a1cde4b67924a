"""Settings from the environment: a bad value stops `ddpdoctor run` in one line, before the job."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import job_env


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DDPDOCTOR_HANG_FLOOR_S", "abc"),
        ("DDPDOCTOR_FLUSH_S", "-1"),
        ("DDPDOCTOR_BUFFER_EVENTS", "1.5"),
        ("DDPDOCTOR_BUCKET_TIMING", "sometimes"),
    ],
)
def test_a_bad_environment_value_is_one_line_and_no_job(tmp_path, name: str, value: str) -> None:
    marker = tmp_path / "ran"
    proc = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "run", "--out", str(tmp_path / "r"), "--", "touch", str(marker)],
        capture_output=True,
        text=True,
        timeout=60,
        env=job_env(**{name: value}),
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: {name}={value!r}: must be " + errors[0].split("must be ", 1)[1]]
    assert not marker.exists()
