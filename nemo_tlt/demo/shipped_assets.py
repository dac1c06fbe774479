"""The demo's trained models shipped as package data, so a first run needs no training.

Layout of ``nemo_tlt/demo/demo_assets/`` (written by ``nemo-tlt prepare --ship DIR``):

    manifest.json       format, per role {name, files: {file: {sha256, bytes}}},
                        the AssetConfig they were trained with, the drafter's
                        measured acceptance, and the versions that made them
    target/ assistant/  HF-format folders (config.json, model.safetensors, warm_start.json)
    drafter/            drafter.json + drafter.safetensors
    drafter_eagle3/     an EAGLE-3 drafter of the target (drafter.json + drafter.safetensors),
                        made by `nemo-tlt drafter train --type eagle3`; train.json holds the
                        command, its settings and report, and the files' checksums

Contract: a role's shipped folder is used only when its ``name`` equals the cache
folder name the current code computes for the requested configuration (a hash of
everything that determines the weights), so a change of config, task or training
recipe falls back to training instead of silently using stale weights. A shipped
folder whose files do not match the manifest's checksums is refused with an error
naming the file (a damaged install is never loaded).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from nemo_tlt.atomic import atomic_output_dir, file_record, sha256_file

SHIPPED_DIR = Path(__file__).resolve().parent / "demo_assets"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
ROLES = ("target", "assistant", "drafter")


def read_manifest(root: Path = SHIPPED_DIR) -> dict[str, Any] | None:
    """The manifest, or None when no assets are shipped at ``root``."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}")
    missing = [r for r in ROLES if r not in manifest.get("assets", {})]
    if missing:
        raise ValueError(f"{path}: assets lack the roles {missing}")
    return manifest


def verify_folder(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    """Raise ValueError naming the first file that is missing or differs from its manifest entry."""
    for name, entry in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path}: listed in {MANIFEST} but missing; reinstall nemo-tlt or run "
                             "`nemo-tlt prepare --rebuild`")
        if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: contents differ from the sha256 in {MANIFEST}; reinstall nemo-tlt or "
                             "run `nemo-tlt prepare --rebuild`")


def shipped_folder(role: str, name: str, root: Path = SHIPPED_DIR) -> Path | None:
    """The verified shipped folder of ``role`` when it was trained as ``name``, else None."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    manifest = read_manifest(root)
    if manifest is None or manifest["assets"][role]["name"] != name:
        return None
    folder = root / role
    verify_folder(folder, manifest["assets"][role]["files"])
    return folder


def write_shipped(folders: dict[str, Path], out: str | os.PathLike, extra: dict[str, Any]) -> Path:
    """Copy the role folders (as the cache holds them) to ``out`` with a manifest; atomic."""
    if sorted(folders) != sorted(ROLES):
        raise ValueError(f"write_shipped needs exactly the roles {ROLES}, got {sorted(folders)}")
    assets: dict[str, Any] = {}
    with atomic_output_dir(out, overwrite=True) as tmp:
        for role, src in folders.items():
            dst = tmp / role
            dst.mkdir()
            files = {}
            for path in sorted(p for p in Path(src).iterdir() if p.is_file()):
                shutil.copyfile(path, dst / path.name)
                files[path.name] = file_record(dst / path.name)
            assets[role] = {"name": Path(src).name, "files": files}
        manifest = {"format": MANIFEST_FORMAT, "assets": assets, **extra}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return Path(out)


EAGLE3_DIR = "drafter_eagle3"
EAGLE3_RECORD = "train.json"


def shipped_eagle3_drafter(root: Path = SHIPPED_DIR) -> Path:
    """The shipped EAGLE-3 drafter folder of the demo target, checked against its record's
    checksums (ValueError naming the file that is missing or differs)."""
    folder = root / EAGLE3_DIR
    record = folder / EAGLE3_RECORD
    if not record.is_file():
        raise ValueError(f"{record}: missing; reinstall nemo-tlt")
    verify_folder(folder, json.loads(record.read_text())["files"])
    return folder
