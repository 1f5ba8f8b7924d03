"""Checkpoint folders and their manifest: what a complete checkpoint is, and which is latest.

A checkpoint is `DIR/ckpt-<step>/` holding one file per stage and, written last, `manifest.json`.
A folder without a manifest is an interrupted save and is never loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

from hyparflow.checkpoint.atomic import write_atomic

FORMAT = 1
MANIFEST = "manifest.json"
_FOLDER = re.compile(r"^ckpt-(\d+)$")


@dataclasses.dataclass
class Manifest:
    """Where training stood and what the checkpoint holds."""

    step: int  # optimizer steps taken
    epoch: int  # epoch of the next batch to run
    batch: int  # index in that epoch of the next batch to run
    seed: int  # shared shuffle seed
    partitions: int
    replicas: int
    weights: list  # [path, shape, dtype] of every model weight, in model order
    files: dict  # file name -> sha256
    architecture: str | None = None  # file holding model.to_json(), if the model has one
    compile_config: str | None = None  # file holding model.get_compile_config()
    format: int = FORMAT
    tensor: int = 1  # tensor ranks per stage (their files hold pieces of split variables)
    callbacks: list = dataclasses.field(default_factory=list)  # Keras callbacks' state

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    def resumed_from(self, folder: str) -> str:
        """What rank 0 says when a run resumes from this checkpoint, in `folder`.

        Example:
            >>> Manifest(6, 1, 2, 0, 2, 1, [], {}).resumed_from("ckpt/ckpt-000000006")
            'hyparflow: resuming from ckpt/ckpt-000000006 after step 6 (epoch 2, its batch 3 next)'
        """
        return (
            f"hyparflow: resuming from {folder} after step {self.step} "
            f"(epoch {self.epoch + 1}, its batch {self.batch + 1} next)"
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"unsupported checkpoint format {data.get('format')!r}")
        return cls(**data)


def folder_name(step: int) -> str:
    return f"ckpt-{step:09d}"


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, folder) of every checkpoint whose manifest exists, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _FOLDER.match(name)
        folder = os.path.join(directory, name)
        if match and os.path.exists(os.path.join(folder, MANIFEST)):
            found.append((int(match.group(1)), folder))
    return sorted(found)


def latest(directory: str) -> str | None:
    """The newest complete checkpoint folder in `directory`, or None."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def read(folder: str) -> Manifest:
    with open(os.path.join(folder, MANIFEST)) as f:
        return Manifest.from_json(f.read())


def write(folder: str, manifest: Manifest) -> None:
    """Write the manifest last: from this moment the checkpoint is complete."""
    write_atomic(os.path.join(folder, MANIFEST), lambda f: f.write(manifest.to_json().encode()))


def prune(directory: str, keep: int, current: str) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and interrupted saves."""
    complete = complete_checkpoints(directory)
    doomed = [folder for _, folder in complete[:-keep]] if keep > 0 else []
    kept = {folder for _, folder in complete}
    for name in os.listdir(directory):
        folder = os.path.join(directory, name)
        if _FOLDER.match(name) and folder not in kept and folder != current:
            doomed.append(folder)  # interrupted save, older than the one just completed
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)


def describe_mismatch(saved: list, current: list) -> str | None:
    """How the checkpoint's weights differ from the model's, or None if they match."""
    if len(saved) != len(current):
        return f"it holds {len(saved)} weights, the model has {len(current)}"
    for (s_path, s_shape, s_dtype), (c_path, c_shape, c_dtype) in zip(saved, current, strict=True):
        if list(s_shape) != list(c_shape) or s_dtype != c_dtype:
            return (
                f"weight {s_path} is {tuple(s_shape)} {s_dtype} in the checkpoint but "
                f"{c_path} is {tuple(c_shape)} {c_dtype} in the model"
            )
    return None
