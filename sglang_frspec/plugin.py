"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``frspec``).

``register()`` only registers hooks; SGLang applies them in every process that loads plugins
(the launcher and each scheduler), before the draft worker is built. It first checks the
contract with SGLang (``adapters/contract.py``): a changed SGLang gets none of the hooks of the
table (``adapters/hooks.py``), only the argument-time refusal of what would then crash; a
supported one gets the table's hooks and those of its form of each seam where releases differ. Nothing
here imports SGLang before that check.
"""


def register() -> None:
    """Install this plugin's hooks into SGLang (none of them if SGLang broke the contract)."""
    from sglang_frspec.adapters import contract

    check = contract.check_running_sglang()
    if not check.holds:
        if check.refusable:  # a token map at TP > 1 fails at argument time, naming what changed
            contract.refuse_token_map_at_tp(check.message)
        return
    import pkgutil

    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_frspec.adapters.args import check_speculative_args
    from sglang_frspec.adapters.hooks import hook_target

    for hook in contract.active_hooks(contract.running_forms()):
        handler = pkgutil.resolve_name(hook.handler)
        HookRegistry.register(hook_target(hook.target), handler, HookType[hook.kind])
    register_resolution_hook("handle_speculative_decoding")(check_speculative_args)
