#!/bin/sh
# The raw-container task of Flyte's generated pods: the area of a circle of radius $1/radius into $2/area,
# as the copilot reads a float (no newline). It works for 6 s first: the 1.15 watcher looks for the task's
# process every 2 s and misses a shorter one.
set -eu
sleep 6
python3 -c 'import math, sys; r = float(open(f"{sys.argv[1]}/radius").read()); open(f"{sys.argv[2]}/area", "w").write(repr(math.pi * r * r))' "$1" "$2"
cat "$2/area"
