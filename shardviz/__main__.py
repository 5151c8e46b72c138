"""``python -m shardviz``: read traces without Jupyter.

    python -m shardviz summary PATH           the trace, one line per event, and its cost summary
    python -m shardviz html PATH OUT.html     the player as one offline HTML file

PATH is a trace file (``trace.save``), a job folder (``sv.record_job``: one file per rank), or
PyTorch Flight Recorder dumps (a folder of per-rank dumps, or one file). A file that cannot be
read is one line on stderr (``shardviz: error: ...``) and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    from shardviz.data.describe import bytes_text
    from shardviz.data.limits import DEFAULTS, ENV, FLAGS, KEYWORDS, WHAT, Limits

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
        p.add_argument(
            "--source-root",
            default=None,
            metavar="DIR",
            help="read Flight Recorder stacks' source lines from files under DIR (never outside it)",
        )
        for f in dataclasses.fields(Limits):
            default = getattr(DEFAULTS, f.name)
            shown = bytes_text(default) if f.name.endswith("bytes") else str(default)
            p.add_argument(
                FLAGS[f.name],
                dest=KEYWORDS[f.name],
                default=None,
                metavar="N",
                help=f"cap on {WHAT[f.name]} (default {shown}, or ${ENV[f.name]})",
            )
    args = parser.parse_args(argv)

    import shardviz as sv
    from shardviz.errors import ShardvizError

    caps = {KEYWORDS[f.name]: getattr(args, KEYWORDS[f.name]) for f in dataclasses.fields(Limits)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the notes are printed with the trace
            trace = sv.load(args.path, allow_pickle=args.allow_pickle, source_root=args.source_root, **caps)
        if isinstance(trace, sv.NumericsReport):  # a saved sv.diff report
            if args.command == "summary":
                print(trace)
                return 0
            print(f"shardviz: writing {args.out} ({len(trace.rows)} rows)", file=sys.stderr)
            print(sv.export_html(trace, args.out))
            return 0
        if args.command == "summary":
            text = f"{trace}\n\n{trace.summary(args.link)}"
            wrong = trace.check()
            if wrong:
                ids = ", ".join(f"#{i}" for i in sorted(wrong))
                text += f"\n\ncheck: outputs that do not follow from the inputs at {ids}"
            print(text)
            return 0
        print(f"shardviz: writing {args.out} ({len(trace.events)} events)", file=sys.stderr)
        path = sv.export_html(trace, args.out)
    except (ShardvizError, OSError) as e:
        print(f"shardviz: error: {_one_line(e)}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _one_line(e: BaseException) -> str:
    """An error as one line: its message's lines joined (a missing file says which)."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    text = str(e) or type(e).__name__
    return " / ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
