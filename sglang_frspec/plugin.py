"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``frspec``).

``register()`` only registers hooks; SGLang applies them in every process that loads plugins
(the launcher and each scheduler), before the draft worker is built. It first checks the
contract with SGLang (``adapters/contract.py``): a changed SGLang gets none of the hooks.
Nothing here imports SGLang before that check.
"""

WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
# The calls that complete a weight update (see adapters/worker.py): one-call updates, and the end
# of a begin/end session (tensor, distributed and P2P/RDMA updates).
COMPLETE_UPDATE_HOOKS = [
    f"{WEIGHT_UPDATER}.update_weights_from_disk",
    f"{WEIGHT_UPDATER}.update_weights_from_ipc",
]
SESSION_END_HOOK = f"{WEIGHT_UPDATER}.end_weight_update"


def register() -> None:
    """Install this plugin's hooks into SGLang (none of them if SGLang broke the contract)."""
    from sglang_frspec.adapters import contract

    if not contract.check_running_sglang():  # logged; at most the argument-time refusal is left
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_frspec.adapters import args, coverage, pd, worker

    HookRegistry.register(args.TOKEN_MAP_HOOK, worker.around_init_token_map, HookType.AROUND)
    HookRegistry.register(args.LM_HEAD_HOOK, worker.around_init_lm_head, HookType.AROUND)
    # Hot coverage of the committed tokens (adapters/coverage.py); registered after the AROUND
    # hook, so it wraps it and sees the hot head installed.
    HookRegistry.register(args.LM_HEAD_HOOK, coverage.install_after_init_lm_head, HookType.AFTER)
    HookRegistry.register(coverage.VERIFY_HOOK, coverage.count_after_verify, HookType.AFTER)
    HookRegistry.register(coverage.REPORT_HOOK, coverage.report_after_decode_stats, HookType.AFTER)
    HookRegistry.register(coverage.IDLE_HOOK, coverage.publish_after_idle, HookType.AFTER)
    HookRegistry.register(coverage.SHUTDOWN_HOOK, coverage.flush_after_release, HookType.AFTER)
    HookRegistry.register(pd.SET_BUF_HOOK, pd.to_wire_before_set_buf, HookType.BEFORE)
    HookRegistry.register(pd.DRAFT_INPUT_HOOK, pd.from_wire_after_draft_input, HookType.AFTER)
    for target in COMPLETE_UPDATE_HOOKS:
        HookRegistry.register(target, worker.refresh_after_complete_update, HookType.AFTER)
    HookRegistry.register(SESSION_END_HOOK, worker.refresh_after_session_end, HookType.AFTER)
    register_resolution_hook("handle_speculative_decoding")(args.check_speculative_args)
