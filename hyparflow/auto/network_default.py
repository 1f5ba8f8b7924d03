"""The network `plan --auto` prices layouts with when the command line gives none.

Planning is offline, so no probe runs inside it: this machine's intra-node link is measured as
`--measure-network` measures it (`mpirun` of two ranks, `simulate/netbench.py`), and the link
between nodes, which one machine cannot measure, is a documented default. Where measuring fails
(no `mpirun`, a timeout) both links are the default. The line returned says which was done, so
a pick is never priced on an assumption the user was not told of.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import replace

from hyparflow.simulate.network import Link, Network

# an InfiniBand-class fabric (HDR 100 Gb/s: about 2 us, 12 GB/s), as docs/simulate.md's examples
DEFAULT_LINK = Link(2e-6, 12e9)
MEASURE_SECONDS = 120  # mpirun's start and the ping-pongs take seconds; a hung launcher does not
HOW_TO_GIVE = "give --latency and --bandwidth, --network FILE or --measure-network"


def network_given(args) -> bool:
    """Whether the command line names a network (`simulate`'s network options)."""
    pair = args.latency is not None and args.bandwidth is not None
    return pair or bool(args.network) or bool(args.measure_network)


def measure_here() -> dict:
    """This machine's network fields, as `--measure-network` measures them."""
    from hyparflow.simulate.netbench import launch

    with tempfile.TemporaryDirectory() as folder:
        return launch(os.path.join(folder, "network.json"), timeout=MEASURE_SECONDS)


def assumed_network(measure=measure_here) -> tuple[Network, str]:
    """The network to plan with when none is given, and the line that says how it was found:
    `measure()`'s (this machine's fields) inside a node with the default between nodes, or the
    default for both where measuring fails."""
    try:
        measured = Network.from_dict(measure())
    except (OSError, RuntimeError, ValueError, KeyError, subprocess.SubprocessError) as error:
        why = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        network = Network(intra=DEFAULT_LINK, inter=DEFAULT_LINK, source={"assumed": "default"})
        return network, (
            f"network: none given, and measuring this machine's failed ({why}); assumed "
            f"{describe(DEFAULT_LINK)} inside and between nodes ({HOW_TO_GIVE})"
        )
    network = replace(measured, inter=measured.inter or DEFAULT_LINK)
    inter = "measured" if measured.inter else f"assumed {describe(DEFAULT_LINK)}"
    return network, (
        f"network: none given; measured this machine's (mpirun, 2 ranks): "
        f"{describe(network.intra)} inside a node; between nodes {inter} ({HOW_TO_GIVE})"
    )


def describe(link: Link) -> str:
    """A link as people write it.

    Example:
        >>> describe(Link(2e-6, 12e9))
        '2.00 us, 12.00 GB/s'
    """
    return f"{link.latency * 1e6:.2f} us, {link.bandwidth / 1e9:.2f} GB/s"
