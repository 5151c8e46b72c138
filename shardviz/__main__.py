"""``python -m shardviz``: read traces without Jupyter.

    python -m shardviz summary PATH           the trace, one line per event, and its cost summary
    python -m shardviz html PATH OUT.html     the player as one offline HTML file

PATH is a trace file (``trace.save``), a job folder (``sv.record_job``: one file per rank), or
PyTorch Flight Recorder dumps (a folder of per-rank dumps, or one file).
"""

from __future__ import annotations

import argparse
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardviz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="print the trace and its communication summary")
    s.add_argument("path", help="a trace file, a job folder, or Flight Recorder dumps")
    s.add_argument("--link", default=None, help='link preset for the cost model ("nvlink4", "ib-ndr", ...)')
    h = sub.add_parser("html", help="write the player as one self-contained HTML file")
    h.add_argument("path", help="a trace file, a job folder, or Flight Recorder dumps")
    h.add_argument("out", help="the HTML file to write")
    for p in (s, h):
        p.add_argument(
            "--allow-pickle",
            action="store_true",
            help="read pickled Flight Recorder dumps (unpickling runs code: only for files you trust)",
        )
    args = parser.parse_args(argv)

    import shardviz as sv
    from shardviz.errors import ShardvizError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the notes are printed with the trace
            trace = sv.load(args.path, allow_pickle=args.allow_pickle)
    except (ShardvizError, OSError) as e:
        print(f"shardviz: {e}", file=sys.stderr)
        return 2
    if args.command == "summary":
        print(trace)
        print()
        print(trace.summary(args.link))
        wrong = trace.check()
        if wrong:
            ids = ", ".join(f"#{i}" for i in sorted(wrong))
            print(f"\ncheck: outputs that do not follow from the inputs at {ids}")
        return 0
    print(f"shardviz: writing {args.out} ({len(trace.events)} events)", file=sys.stderr)
    path = sv.export_html(trace, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
