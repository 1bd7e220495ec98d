"""python3 -m kvq.conform --target module:function: kvq conform for a Python kernel.

Imports the target (an object with any of write(), stage(), write_cache(), attend(), or a write
function: see kvq.conformance; its `adapter` attribute, a kvq.conformance.Adapter, maps foreign
planes), replays the stage, pipeline, cache and attention cases through it, prints kvq conform's table with
each case's tier (--accept, --bound, --edge-rows: spec/verdicts.md) and exits with status 2
when a case failed (1 for a usage or kvq error), as kvq conform does.
"""
import argparse
import json
import sys

from . import conformance
from ._kvq import Error


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m kvq.conform", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--target", required=True, help="module:attribute of the kernel")
    parser.add_argument("--kinds", default=",".join(conformance.KINDS),
                        help="case kinds, comma-separated (default: %(default)s)")
    parser.add_argument("--formats", default=None,
                        help="formats, comma-separated (default: every format)")
    parser.add_argument("--vectors", default=None, help="vectors folder (default: "
                        "kvq.vectors.default_dir())")
    parser.add_argument("--json", default=None, help="also write the report here as JSON")
    parser.add_argument("--failures-only", action="store_true",
                        help="print only the table rows of failing cases")
    parser.add_argument("--accept", default="exact", choices=conformance.TIERS[:3],
                        help="the worst tier that passes (spec/verdicts.md; default: exact)")
    parser.add_argument("--bound", type=float, default=conformance.DEFAULT_BOUND,
                        help="the boundary rule's bound in code units (default: %(default)s)")
    parser.add_argument("--edge-rows", default="judged", choices=("judged", "apart"),
                        help="edge groups count toward the case's tier, or are reported apart")
    args = parser.parse_args(argv)
    try:
        report = conformance.check(
            conformance.load_target(args.target), kinds=args.kinds.split(","),
            formats=args.formats.split(",") if args.formats else None, vectors=args.vectors,
            failures_only=args.failures_only, name=args.target, accept=args.accept,
            bound=args.bound, edge_rows=args.edge_rows)
    except Error as e:
        print("error: %s" % e, file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
            f.write("\n")
    return 2 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
