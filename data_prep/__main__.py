"""`python -m data_prep shard --input PATH… [--out DIR] [--config YAML] [--set key=value …]`
   (inputs: --input, or inputs in --config/--set; DIR: default $LLM_PIPELINE_VAR_DIR/data, else <repo>/var/data;
   --input/--out replace the --config file's inputs/out_dir, and refuse --set inputs=/out_dir= beside them;
   relative paths in the --config file are read from the repository, as the pipeline reads that file, and those
   on the command line from the working directory; shard_multiple 0 is 1 here, ranks × loader workers in the
   pipeline: to pre-build the set `python -m tasks shard` finds, --set shard_multiple= the pipeline's, e.g. 2 for
   configs/ci-tiny.yaml)
   `python -m data_prep verify DIR [--split train]`   (tokenizer files, sizes + sha256 of every shard, against the
                                                       manifest)

Errors print one line and exit 2. The pipeline's own entry is `python -m tasks shard` (same code, plus MLflow).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys

from data_prep.config import ShardConfig, config_paths, default_out_dir
from data_prep.errors import DataPrepError, OneLineParser

log = logging.getLogger("data_prep")
LOADER_ONLY = ("loader_workers", "prefetch_factor")  # data keys only the loader reads


def _overrides(sets: list[str]) -> dict:
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise DataPrepError(f"--set {item!r}: expected key=value")
        # data.text_field, as the pipeline and this CLI's own warnings name it, is the same key here; each value is
        # read as its field's type by the model (data_prep.config.from_text)
        out[key.strip().removeprefix("data.")] = value
    return out


def _unused_settings(overrides: dict, cfg: ShardConfig) -> None:
    """--set of the loader's own settings: valid data keys (a preset's data: section holds them), but no shard build
    reads them; said, not ignored without a word."""
    loader = [k for k in LOADER_ONLY if k in overrides]
    if loader:
        log.warning(
            "%s: the loader's setting(s) (the train stage's data feeding), not used by a shard build; leave them out "
            "of --set (in the pipeline loader_workers sizes the automatic shard_multiple: give shard_multiple here)",
            ", ".join(f"{k}={getattr(cfg, k)}" for k in loader),
        )


def main(argv=None) -> int:
    parser = OneLineParser(
        prog="python -m data_prep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    shard = sub.add_parser("shard", help="build (or find cached) a shard set")
    shard.add_argument(
        "--input",
        nargs="+",
        default=None,
        help="files, directories, globs or 'stdlib' (required, unless --config or --set gives inputs)",
    )
    shard.add_argument(
        "--out",
        default=None,
        help="output root; the shard set is <out>/<version>/ (default: out_dir of --config/--set, else "
        "$LLM_PIPELINE_VAR_DIR/data, else <repo>/var/data)",
    )
    shard.add_argument("--config", default=None, help="YAML: a pipeline preset (its data: section) or flat keys")
    shard.add_argument(
        "--set",
        dest="sets",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help=f"override settings, several after one --set or --set repeated ({', '.join(ShardConfig.model_fields)})",
    )
    shard.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    verify = sub.add_parser("verify", help="check the tokenizer files and every shard's size and sha256")
    verify.add_argument("shard_dir")
    verify.add_argument("--split", action="append", default=None, help="only this split (repeatable; default: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = None
    try:
        if args.command == "verify":
            from data_prep.manifest import check_files, load_manifest

            manifest = load_manifest(args.shard_dir)
            for split in args.split or list(manifest["splits"]):
                check_files(args.shard_dir, manifest, split, sha256=True)
            print(f"ok: {args.shard_dir} matches its manifest")
            return 0
        from data_prep.build import build_shard_set
        from data_prep.layout import ended_line

        overrides = _overrides(args.sets)
        for flag, key, given in (("--input", "inputs", args.input), ("--out", "out_dir", args.out)):
            if given is not None and key in overrides:  # one would silently replace the other
                raise DataPrepError(f"{flag} and --set {key}=… both give {key}; keep one")
        if args.out is not None and not args.out.strip():
            raise DataPrepError("--out is empty; give the output directory (or leave --out out for the default)")
        if args.input is not None:
            overrides["inputs"] = args.input
        if args.out is not None:
            overrides["out_dir"] = args.out
        # A --config file's paths are read as the pipeline reads that file (from the repository); the command line's
        # (--input, --out, --set) from the working directory, where they were typed.
        from_file = config_paths(ShardConfig.yaml_values(args.config), f"config {args.config}") if args.config else {}
        values = {**from_file, **overrides}
        if "inputs" not in values:  # never the model's default (the whole standard library) unasked
            raise DataPrepError(
                "no inputs: give --input PATH… (files, directories, globs; 'stdlib' for the Python standard "
                "library), or inputs in --config/--set"
            )
        values.setdefault("out_dir", str(default_out_dir()))  # not ./var of the working directory
        cfg = ShardConfig.from_dict(values)
        if "inputs" in overrides:  # typed here: recorded (manifest, job) as absolute, not as the spelling of one cwd
            absolute = [p if p == "stdlib" else os.path.abspath(os.path.expanduser(p)) for p in cfg.inputs]
            cfg = cfg.model_copy(update={"inputs": absolute})
        _unused_settings(overrides, cfg)
        result = build_shard_set(cfg)
        if "vocab_size" in overrides and cfg.tokenizer != "train":  # as the pipeline's shard stage says it
            log.warning(
                "data.vocab_size %s is not used: the given tokenizer (data.tokenizer) keeps its own vocabulary of %d "
                "tokens; unset data.vocab_size (it sizes only a BPE trained on the corpus)",
                cfg.vocab_size,
                result.manifest["vocab_size"],
            )
    except DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full or read-only disk: the path and the errno; a rerun resumes the build
        name = errno.errorcode.get(e.errno or 0, "")
        # a write's flush/fsync error carries no file name: then the output directory is where it happened
        target = e.filename or (
            f"under {cfg.out_dir}" if cfg is not None else (args.shard_dir if "shard_dir" in args else "")
        )
        where = f"{target}: " if target else ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space there"
        elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = "make it writable"
        else:
            fix = "fix the cause"
        print(
            f"error: {where}{e.strerror or e}{f' ({name})' if name else ''}; {fix}, then rerun (finished steps are "
            "kept)",
            file=sys.stderr,
        )
        return 2
    summary = {
        "shard_dir": str(result.shard_dir),
        "cache_hit": result.cache_hit,
        "manifest_digest": result.digest,
        "tokens": result.tokens,
        "tokens_per_s": round(result.tokens_per_s),
        "partitions": result.partitions,
        "tokenizer_identity": result.manifest["tokenizer"]["identity"],
        "splits": {
            k: {"samples": v["samples"], "shards": len(v["shards"])} for k, v in result.manifest["splits"].items()
        },
    }
    ended = result.manifest["source"].get("ended")
    if ended:
        summary["ended"] = ended
    print(
        json.dumps(summary, indent=2)
        if args.json
        else f"{'cached' if result.cache_hit else 'built'} {result.shard_dir} "
        + " ".join(f"{k}={v['samples']} samples/{v['shards']} shards" for k, v in summary["splits"].items())
        + (f"; {ended_line(ended)}" if ended else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
