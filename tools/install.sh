#!/bin/sh
# tools/install.sh VENV ARGS...: install into the virtual environment VENV what ARGS name, in pip install's syntax.
# With uv (pinned below, itself installed into VENV from the registry) when it can be had: the same pins, several
# times faster (docs/benchmarks.md); else, or with EAGLEPIPE_PIP=1, with pip. uv reads no pip configuration, so the
# find-links folder pip is given (this machine keeps its CPU build of torch in one) is handed to it.
set -e
venv=$1
shift
if [ -z "$EAGLEPIPE_PIP" ] && { [ -x "$venv/bin/uv" ] || "$venv/bin/pip" install -q uv==0.13.9; }; then
    links=${PIP_FIND_LINKS:-$("$venv/bin/pip" config get global.find-links 2>/dev/null || true)}
    exec "$venv/bin/uv" pip install -q --python "$venv/bin/python" ${links:+--find-links "$links"} "$@"
fi
exec "$venv/bin/pip" install -q "$@"
