"""The bootstrap: chains to the user's sitecustomize; arms probes only under `ddpdoctor run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import job_env

from ddpdoctor.supervisor.launch import BOOTSTRAP_DIR, job_environment


def python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_users_sitecustomize_still_runs(tmp_path: Path) -> None:
    user_site = tmp_path / "usersite"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import builtins; builtins.USER_SITE_RAN = True\n")
    base = job_env()
    base["PYTHONPATH"] = f"{user_site}:{base['PYTHONPATH']}"
    env = job_environment(tmp_path / "run", base)
    assert env["PYTHONPATH"].split(":")[0] == str(BOOTSTRAP_DIR)
    proc = python(
        "import builtins, sys; print(builtins.USER_SITE_RAN, 'ddpdoctor.probes' in sys.modules)",
        env,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def test_bootstrap_never_imports_torch_and_patches_on_import(tmp_path: Path) -> None:
    env = job_environment(tmp_path / "run", job_env())
    code = (
        "import sys; assert 'torch' not in sys.modules\n"
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "print(hasattr(dist.barrier, '__ddpdoctor_original__'),"
        " hasattr(DDP.forward, '__ddpdoctor_original__'))\n"
        "from ddpdoctor.probes import collector; print(collector.ACTIVE)\n"
    )
    proc = python(code, env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "None"]  # patched, but not a rank: inert
    assert not (tmp_path / "run").exists()


def test_without_run_dir_the_bootstrap_does_nothing(tmp_path: Path) -> None:
    env = job_environment(tmp_path / "run", job_env())
    del env["DDPDOCTOR_RUN_DIR"]
    proc = python(
        "import sys, torch.distributed as d;"
        " print('ddpdoctor' in sys.modules, hasattr(d.barrier, '__ddpdoctor_original__'))",
        env,
        tmp_path,
    )
    assert proc.stdout.split() == ["False", "False"]


def test_broken_user_sitecustomize_is_reported_and_probes_still_arm(tmp_path: Path) -> None:
    user_site = tmp_path / "usersite"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("raise ValueError('user bug')\n")
    base = job_env()
    base["PYTHONPATH"] = f"{user_site}:{base['PYTHONPATH']}"
    env = job_environment(tmp_path / "run", base)
    proc = python("import sys; print('ddpdoctor.probes' in sys.modules)", env, tmp_path)
    assert proc.returncode == 0
    assert "user bug" in proc.stderr
    assert proc.stdout.strip() == "True"
