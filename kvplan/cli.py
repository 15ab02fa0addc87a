"""The ``kvplan`` console script. Each command is a thin layer over a Python function.

Errors a user can cause (bad plan, missing model package, bad budget) print one line
``kvplan: error: ...`` and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from .errors import KVPlanError


def _cmd_validate(args) -> int:
    from .plans import Plan

    plan = Plan.from_yaml(args.plan)
    if args.model:
        from .models import load_model
        from .runtime import resolve_plan

        model, _ = load_model(args.model)
        resolve_plan(args.plan, model)
    bpv = plan.bpv()
    ref = plan.reference
    print(f"{args.plan}: valid kvplan plan for {plan.geometry.model_type} "
          f"({plan.geometry.num_layers} layers x {plan.geometry.num_kv_heads} KV heads, "
          f"head_dim {plan.geometry.head_dim}); modalities {list(plan.modalities)}")
    print(f"honest bpv {bpv.total:.4f} (payload {bpv.payload:.4f}, scales/zeros {bpv.scales_zeros:.4f}, "
          f"residual {bpv.residual:.4f}) at {ref.context_len} tokens, mix {dict(ref.modality_mix)}")
    return 0


def _cmd_generate(args) -> int:
    from .runtime.demo import generate_demo

    generate_demo(args.plan, model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    p = argparse.ArgumentParser(prog="kvplan", description="Find, explain and deploy mixed-precision KV-cache plans.")
    p.add_argument("--version", action="version", version=f"kvplan {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    v = sub.add_parser("validate", help="check a plan file (and optionally that it fits a model)")
    v.add_argument("plan", help="plan YAML file")
    v.add_argument("--model", help="also check the plan against this model (name, .gguf, dir or hub id)")
    v.set_defaults(func=_cmd_validate)

    g = sub.add_parser("generate", help="generate text on a plan's quantized cache and report its memory")
    g.add_argument("--plan", default="int4", help="plan YAML file or baseline name (default: int4)")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--prompt", default=None, help="default: a ~800-token Python-docs question")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.set_defaults(func=_cmd_generate)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVPlanError as e:
        print(f"kvplan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvplan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
