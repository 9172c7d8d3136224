#!/bin/sh
# The raw-container task of Flyte's examples: the area of an ellipse with semi-axes $1/a and $1/b into $2/area.
set -eu
python3 -c 'import math, sys; a, b = (float(open(f"{sys.argv[1]}/{n}").read()) for n in "ab"); open(f"{sys.argv[2]}/area", "w").write(f"{math.pi * a * b}\n")' "$1" "$2"
cat "$2/area"
