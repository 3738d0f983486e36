#!/bin/sh
# Hydra's launcher for simulated hosts: MPICH's "ssh" launcher calls `nsexec.sh [-x ...] HOST COMMAND...`; COMMAND runs
# in HOST's network namespace (`ip netns`, which also bind-mounts /etc/netns/HOST/hosts) with its own UTS hostname.
while [ "${1#-}" != "$1" ]; do shift; done
host="$1"; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; exec $*"
