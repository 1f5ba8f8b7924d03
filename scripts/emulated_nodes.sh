#!/bin/sh
# Run Open MPI's mpirun across emulated nodes on this one machine (docs/nodes.md).
#
#   scripts/emulated_nodes.sh nodeA:2,nodeB:2 -np 4 .venv/bin/python train.py
#   eval "$(scripts/emulated_nodes.sh --environment)"   # the same settings, for any mpirun
#
# Each host named in the first argument becomes a "node": its ranks run in a UTS namespace of
# their own (`unshare -u`) whose host name is that name, so Open MPI sees several nodes. Within
# a node ranks talk through shared memory (vader); between nodes through TCP. Everything stays
# on the loopback interface (`lo`): no other address is ever used. Needs root (or a user
# allowed to unshare) and Open MPI 4.x; arguments after the first go to mpirun unchanged.
#
# Open MPI starts each node's daemon through a launch agent, as it would through ssh; this
# script is that agent when called as `emulated_nodes.sh --agent HOST COMMAND...`. A node can
# be taken down: while the folder $EMULATED_NODES_DOWN holds a file named after the host, the
# agent refuses it as ssh refuses a dead host (exit status 255).
set -eu

if [ "${1:-}" = "--agent" ]; then
    host=$2
    shift 2
    if [ -n "${EMULATED_NODES_DOWN:-}" ] && [ -e "$EMULATED_NODES_DOWN/$host" ]; then
        echo "ssh: connect to host $host port 22: No route to host" >&2
        exit 255
    fi
    # Open MPI hands over the remote command as one string, as ssh would get it.
    exec unshare --uts sh -c "hostname $host && exec $*"
fi

agent="$(cd "$(dirname "$0")" && pwd)/$(basename "$0") --agent"
# routed direct: without it Open MPI 4.1 fails with an internal routing error across the
# namespaces. The tcp settings keep both the daemons' wire-up (oob) and MPI's messages (btl)
# on the loopback interface, IPv4 only.
export OMPI_MCA_plm_rsh_agent="$agent"
export OMPI_MCA_routed=direct
export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_oob_tcp_disable_ipv6_family=1
export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_btl_tcp_disable_family=6

if [ "${1:-}" = "--environment" ]; then
    env | grep '^OMPI_MCA_\(plm_rsh_agent\|routed\|oob_tcp\|btl\)' | sort | sed "s/^\([^=]*\)=\(.*\)$/export \1='\2'/"
    exit 0
fi

if [ $# -lt 2 ]; then
    echo "usage: $0 HOST:SLOTS[,HOST:SLOTS...] MPIRUN_ARGUMENTS... (e.g. nodeA:2,nodeB:2 -np 4 prog)" >&2
    echo "       $0 --environment   (print these settings as OMPI_MCA_* exports)" >&2
    exit 2
fi
hosts=$1
shift
exec mpirun --host "$hosts" "$@"
