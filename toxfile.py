"""tox plugin (loaded by tox from the project root): lets the `gpu` env see
the packages of the interpreter that runs tox.

GPU machines ship torch, CUDA and Cython preinstalled, often inside a
virtualenv, and may have no network. A tox env created from a virtualenv's
python with system_site_packages sees the *base* interpreter's packages, not
that virtualenv's. So before the gpu env's commands run, this writes a .pth
file into the env that appends the host interpreter's site-packages to
sys.path (after the env's own, which still win).
"""
from __future__ import annotations

import site
import sysconfig
from pathlib import Path

from tox.plugin import impl

HOST_SITE_ENVS = {"gpu", "gpu-newest", "gpu-soak", "gpu-csan"}


@impl
def tox_before_run_commands(tox_env) -> None:
    if tox_env.name not in HOST_SITE_ENVS:
        return
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    unique = list(dict.fromkeys(p for p in paths if Path(p).is_dir()))
    target = Path(tox_env.env_site_package_dir()) / "_prefetch_host_site.pth"
    target.write_text("".join(f"{p}\n" for p in unique))
