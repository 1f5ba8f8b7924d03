"""This process's memory limit and the room left under it: the tightest cgroup (v1 or v2)
limit over its cgroup's ancestors; and each rank's share of the room when ranks share a
cgroup (a Slurm job's) or have one each."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value
_UNLIMITED = 2**62


def memory_limit(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process may hold before its cgroup reclaims or kills it, or None (no limit,
    or no cgroup memory controller readable).

    Reads the process's cgroup from `proc` and the limits of it and its ancestors under
    `root` (v1: `memory/.../memory.limit_in_bytes`; v2: `.../memory.max`); the tightest wins.

    For example:
        limit = memory_limit()
        plan.largest.total > limit if limit else False   # the plan cannot fit here
    """
    found = _controller(root, proc)
    return None if found is None else _tightest(found[0], found[1], found[2][0])


def memory_room(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's cgroups can still be charged before one reaches its limit (the
    smallest limit minus usage over the cgroup and its ancestors), or None where no limit is
    set or readable. What a cgroup is charged, not the process's resident size: shared
    library pages already charged elsewhere do not count against it.

    For example:
        room = memory_room()
        plan.largest.total > room if room is not None else False
    """
    found = cgroup_room(root, proc)
    return None if found is None else found.room


@dataclass(frozen=True)
class CgroupRoom:
    """Where a process's memory room is smallest: its own cgroup, the (ancestor) cgroup whose
    limit minus usage is least, and that room in bytes."""

    own: str
    limiting: str
    room: int


def cgroup_room(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> CgroupRoom | None:
    """This process's `CgroupRoom`, or None where no limit is set or readable.

    For example:
        found = cgroup_room()  # CgroupRoom(own="/job/7/rank0", limiting="/job/7", room=...)
    """
    found = _controller(root, proc)
    if found is None:
        return None
    mount, path, names = found
    rooms = []
    for cgroup, directory in _ancestors(mount, path):
        try:
            with open(os.path.join(directory, names[0])) as f:
                limit = parse_limit(f.read())
            with open(os.path.join(directory, names[1])) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit is not None:
            rooms.append((limit - usage, cgroup))
    if not rooms:
        return None
    room, limiting = min(rooms)
    return CgroupRoom(next(_ancestors(mount, path))[0], limiting, room)


def _ancestors(mount: str, path: str):
    """(cgroup path, its folder under `mount`) for the cgroup at `path` and each ancestor up
    to the mount's root, innermost first."""
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        yield "/" + "/".join(parts[:depth]), os.path.join(mount, *parts[:depth])


def share_per_rank(found: Sequence[tuple[int, CgroupRoom | None]]) -> int | None:
    """The bytes every rank may still take: each rank's room shared by the ranks of its node
    inside the same limiting cgroup, the smallest over ranks. `found`: (node, its CgroupRoom
    or None) per rank; None when no rank has a limit.

    Example:
        >>> shared = [(0, CgroupRoom("/job", "/job", 800)), (0, CgroupRoom("/job", "/job", 800))]
        >>> share_per_rank(shared)  # a Slurm job's cgroup, two ranks in it
        400
        >>> own = [(0, CgroupRoom("/r0", "/r0", 800)), (0, CgroupRoom("/r1", "/r1", 700))]
        >>> share_per_rank(own)  # a cgroup each
        700
    """
    shares = []
    for node, room in found:
        if room is None:
            continue
        inside = sum(
            1
            for other_node, other in found
            if other_node == node and other is not None and _within(other.own, room.limiting)
        )
        shares.append(room.room // max(1, inside))
    return min(shares) if shares else None


def _within(path: str, ancestor: str) -> bool:
    return path == ancestor or path.startswith(ancestor.rstrip("/") + "/")


def _controller(root: str, proc: str):
    """(mount, this process's cgroup path, (limit file, usage file)) of the memory controller
    (v1 first, else v2), or None where neither is readable."""
    try:
        with open(proc) as f:
            text = f.read()
    except OSError:
        return None
    v1, v2 = cgroup_paths(text)
    if v1 is not None and os.path.isdir(os.path.join(root, "memory")):
        return os.path.join(root, "memory"), v1, ("memory.limit_in_bytes", "memory.usage_in_bytes")
    if v2 is not None and os.path.exists(os.path.join(root, "cgroup.controllers")):
        return root, v2, ("memory.max", "memory.current")
    return None


def cgroup_paths(text: str) -> tuple[str | None, str | None]:
    """(the v1 memory controller's cgroup path, the v2 unified path) from /proc/PID/cgroup.

    Example:
        >>> cgroup_paths("4:memory:/jobs/7\\n0::/user.slice\\n")
        ('/jobs/7', '/user.slice')
    """
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif parts[0] == "0" and controllers == "":
            v2 = path
    return v1, v2


def parse_limit(text: str) -> int | None:
    """A limit file's bytes, or None for "max" (v2) or v1's near-2**63 "unlimited".

    Example:
        >>> parse_limit("max\\n"), parse_limit("9223372036854771712"), parse_limit("1048576")
        (None, None, 1048576)
    """
    text = text.strip()
    if not text or text == "max":
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def _tightest(mount: str, path: str, name: str) -> int | None:
    """The smallest limit from the cgroup at `path` up to the mount's root. Inside a cgroup
    namespace the path may not exist under the mount, which then is the cgroup itself."""
    limits = []
    for _, directory in _ancestors(mount, path):
        try:
            with open(os.path.join(directory, name)) as f:
                limits.append(parse_limit(f.read()))
        except (OSError, ValueError):
            continue
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None
