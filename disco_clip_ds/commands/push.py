"""`disco-clip push OUTPUT_DIR --repo_id USER/NAME [--private] [--revision R] [--dry_run]`: upload a folder written
by `disco-clip export` to the Hugging Face hub in one commit (disco_clip_ds.export.hub)."""

from __future__ import annotations

from disco_clip_ds.cli import ArgumentParser, DefaultsOnce


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, push (or, with --dry_run, print the plan); return 0."""
    from disco_clip_ds.export.hub import push_folder

    parser = ArgumentParser(
        formatter_class=DefaultsOnce,
        prog="disco-clip push",
        description="upload an exported model folder to the Hugging Face hub",
    )
    parser.add_argument("folder", help="a folder written by `disco-clip export`")
    parser.add_argument("--repo_id", required=True, help="USER/NAME or ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", help="branch to push to (created when missing; default main)")
    parser.add_argument("--dry_run", action="store_true", help="list what would be uploaded where, contact nothing")
    args = parser.parse_args(argv)
    url = push_folder(args.folder, args.repo_id, private=args.private, revision=args.revision, dry_run=args.dry_run)
    if not args.dry_run:
        print(f"pushed {args.folder} -> {url}")
    return 0
