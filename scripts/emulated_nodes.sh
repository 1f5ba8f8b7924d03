#!/bin/sh
# Run Open MPI's mpirun across emulated nodes on this one machine (docs/nodes.md).
#
#   scripts/emulated_nodes.sh nodeA:2,nodeB:2 -np 4 .venv/bin/python train.py
#
# Each host named in the first argument becomes a "node": its ranks run in a UTS namespace of
# their own (`unshare -u`) whose host name is that name, so Open MPI sees several nodes. Within
# a node ranks talk through shared memory (vader); between nodes through TCP. Everything stays
# on the loopback interface (`lo`): no other address is ever used. Needs root (or a user
# allowed to unshare) and Open MPI 4.x; arguments after the first go to mpirun unchanged.
#
# Open MPI starts each node's daemon through a launch agent, as it would through ssh; this
# script is that agent when called as `emulated_nodes.sh --agent HOST COMMAND...`.
set -eu

if [ "${1:-}" = "--agent" ]; then
    host=$2
    shift 2
    # Open MPI hands over the remote command as one string, as ssh would get it.
    exec unshare --uts sh -c "hostname $host && exec $*"
fi

if [ $# -lt 2 ]; then
    echo "usage: $0 HOST:SLOTS[,HOST:SLOTS...] MPIRUN_ARGUMENTS... (e.g. nodeA:2,nodeB:2 -np 4 prog)" >&2
    exit 2
fi
hosts=$1
shift
agent="$(cd "$(dirname "$0")" && pwd)/$(basename "$0") --agent"
# routed direct: without it Open MPI 4.1 fails with an internal routing error across the
# namespaces. The tcp settings keep both the daemons' wire-up (oob) and MPI's messages (btl)
# on the loopback interface, IPv4 only.
exec mpirun \
    --host "$hosts" \
    --mca plm_rsh_agent "$agent" \
    --mca routed direct \
    --mca oob_tcp_if_include lo --mca oob_tcp_disable_ipv6_family 1 \
    --mca btl self,vader,tcp --mca btl_tcp_if_include lo --mca btl_tcp_disable_family 6 \
    "$@"
