"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``frspec``).

``register()`` only registers hooks; SGLang applies them in every process that loads plugins
(the launcher and each scheduler), before the draft worker is built.
"""

from sglang_frspec.adapters.args import LM_HEAD_HOOK, TOKEN_MAP_HOOK

WEIGHT_UPDATES = "sglang.srt.managers.scheduler_components.weight_updater"
WEIGHT_UPDATE_HOOKS = [
    f"{WEIGHT_UPDATES}.SchedulerWeightUpdaterManager.{method}"
    for method in (
        "update_weights_from_disk",
        "update_weights_from_tensor",
        "update_weights_from_distributed",
        "update_weights_from_ipc",
    )
]


def register() -> None:
    """Install this plugin's hooks into SGLang."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_frspec.adapters import args, worker

    HookRegistry.register(TOKEN_MAP_HOOK, worker.around_init_token_map, HookType.AROUND)
    HookRegistry.register(LM_HEAD_HOOK, worker.around_init_lm_head, HookType.AROUND)
    for target in WEIGHT_UPDATE_HOOKS:
        HookRegistry.register(target, worker.refresh_after_weight_update, HookType.AFTER)
    register_resolution_hook("handle_speculative_decoding")(args.check_speculative_args)
