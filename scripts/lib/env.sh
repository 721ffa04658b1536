# Sourced (from the repo root) first by every script that starts a Python process.
# WEIGHTSYNC_TORCH, WEIGHTSYNC_TIERS and WEIGHTSYNC_VLLM_TIER, the README's names for the scripts'
# settings, are no config fields, and SyncConfig.from_env refuses a WEIGHTSYNC_ variable that
# names none: each goes on as WSTEST_<NAME>, which the scripts read, and leaves the environment
# of every process they start. The scripts' other settings are WSTEST_ names only.
for _ws_name in TORCH TIERS VLLM_TIER; do
    _ws_var="WEIGHTSYNC_$_ws_name"
    if [ -n "${!_ws_var+x}" ]; then
        export "WSTEST_$_ws_name=${!_ws_var}"
        unset "$_ws_var"
    fi
done
unset _ws_name _ws_var
