# Sourced by scripts/test.sh and scripts/run_demo.sh: builds .venv on a fresh machine.
# torch==2.13.0 goes in first: nixl declares a torch dependency, and without a torch already
# installed pip resolves the newest CUDA build (several GB). With 2.13.0 present it adds nothing.
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.kvbridge-installed
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
    echo "$want" > "$stamp"
fi
