"""Where a result came from: the commit (and whether the tree was dirty), the device, versions.

``KVSTREAM_GIT_COMMIT`` names the commit of a copied checkout whose git metadata is missing or
stale (a remote GPU machine's copy of the tree): the tree is then taken to be that commit, clean.
"""
from __future__ import annotations

import os
import platform
import subprocess

import torch


def git_state(*paths: str) -> tuple[str, bool]:
    """(commit, dirty), dirty meaning uncommitted changes (under ``paths`` if given)."""
    named = os.environ.get("KVSTREAM_GIT_COMMIT")
    if named:
        return named, False

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD")
    return commit or "unknown", not commit or bool(git("status", "--porcelain", *paths))


def provenance() -> dict:
    """Commit, dirty flag, device and versions, as columns of a result row."""
    import triton
    commit, dirty = git_state()
    return {"git_commit": commit, "git_dirty": dirty,
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
