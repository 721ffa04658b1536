# Sourced (from the repo root) by the scripts that build a tier's venv: vllm_env.sh,
# vllm_cpu_env.sh, verl_e2e_env.sh. A stamp file in the venv records what was installed (the
# script's KEY); when it matches, the script prints the venv's python and exits at once, so a
# tier run on a venv that is already built costs about a second.
#
#   venv_reuse VENV STAMP KEY   waits for any other build of VENV, then prints VENV/bin/python
#                               and exits 0 if STAMP holds KEY
#   venv_start VENV             drops STAMP's claim, creates VENV if needed and activates it;
#                               sets pip_q (quiet pip install) and started (seconds)
#   venv_done VENV STAMP KEY    writes STAMP, says how long it took, prints VENV/bin/python
#   pyproject_hash              what of pyproject.toml a KEY records (weightsync's own deps)

pyproject_hash() { sha256sum pyproject.toml | cut -c1-16; }

venv_reuse() {
    # one build of a venv at a time: scripts/test.sh prepares the tiers' venvs in the background
    # while earlier tiers run, and a tier that reaches its venv first waits here for that build;
    # the lock goes with this script's process
    mkdir -p "$1"
    exec 9> "$1/.weightsync-lock"
    flock 9
    if [ -f "$2" ] && [ "$(cat "$2")" = "$3" ] && [ -x "$1/bin/python" ]; then
        echo "$1/bin/python"
        exit 0
    fi
}

venv_start() {
    started=$(date +%s)
    rm -f "$1"/.weightsync-*-stamp  # an install that stops half way leaves no valid stamp
    [ -x "$1/bin/python" ] || "${PYTHON:-python3}" -m venv "$1"
    # shellcheck disable=SC1091
    . "$1/bin/activate"
    pip_q="pip install --quiet --disable-pip-version-check"
    # a pip.conf may list index locations that do not exist: pip warns once per package about them
    exec 2> >(grep --line-buffered -v "is neither a file nor a directory" >&2)
}

venv_done() {
    echo "$3" > "$2"
    echo "weightsync: $1 ready in $(( $(date +%s) - started )) s" >&2
    echo "$1/bin/python"
}
