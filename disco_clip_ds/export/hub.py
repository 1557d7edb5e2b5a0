"""Upload a folder written by `disco-clip export` to a Hugging Face hub model repo, in one commit (`disco-clip push`:
commands/push.py; training with --push_to_hub).

Only exported folders are pushed (never raw Trainer/DeepSpeed state); the token comes from huggingface_hub's usual
places (HF_TOKEN, `hf auth login`'s cache).
"""

from __future__ import annotations

import os
from pathlib import Path

from disco_clip_ds.checkpoint.layout import has_weights
from disco_clip_ds.data.redact import find_secret
from disco_clip_ds.errors import ExportError, UsageError

SNIFF_BYTES = 8192  # a file with a NUL byte in its first 8 KiB is binary: weights, not text a secret is pasted into


def upload_plan(folder: str | os.PathLike) -> list[tuple[str, int]]:
    """(path in repo, bytes) of every file that `push_folder` uploads, after checking it is an export that holds no
    known secret (`secret_problem`)."""
    folder = Path(folder)
    if not folder.exists():
        raise UsageError(f"'{folder}' does not exist: pass a folder written by `disco-clip export`")
    if not folder.is_dir():
        raise UsageError(f"'{folder}' is a file, not a folder: pass a folder written by `disco-clip export`")
    if (folder / "latest").exists() or any(folder.glob("global_step*")) or any(folder.glob("checkpoint-*")):
        raise ExportError(
            f"'{folder}' holds raw Trainer/DeepSpeed state: run `disco-clip export {folder} OUTPUT_DIR` and "
            "push OUTPUT_DIR"
        )
    if not (folder / "config.json").is_file() or not has_weights(folder):
        raise ExportError(f"'{folder}' is not an exported model folder (needs config.json and model.safetensors)")
    files = sorted(
        p
        for p in folder.rglob("*")
        if (p.is_file() or p.is_symlink()) and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    root = folder.resolve()
    for path in files:
        if path.is_symlink() and not path.resolve().is_relative_to(root):
            raise ExportError(
                f"'{path}' is a link to '{path.resolve()}', outside the folder: an upload would publish that file; "
                "replace the link by the file it should be, or remove it, and push again; nothing was uploaded"
            )
        problem = secret_problem(path)
        if problem:
            raise ExportError(
                f"'{path}' {problem}: a public upload would publish it; remove it (or, for README.md, export the "
                "checkpoint again: the card is written without secrets or local paths) and push again; nothing was "
                "uploaded"
            )
    files = [p for p in files if p.is_file()]  # a link inside the folder to a folder: its files are listed
    return [(p.relative_to(folder).as_posix(), p.stat().st_size) for p in files]


def secret_problem(path: Path) -> str | None:
    """Where `path` holds a known secret (data/redact.py SECRETS: hf_ tokens, bearer tokens, AWS keys, passwords
    and tokens in URLs), as 'line N holds KIND'; None if it holds none. Text files are read whole; a safetensors
    file's JSON header (its metadata may hold text) is read; other binary files (weights) are not."""
    with path.open("rb") as f:
        head = f.read(SNIFF_BYTES)
        if path.suffix == ".safetensors" and len(head) >= 8:
            f.seek(0)
            size = int.from_bytes(f.read(8), "little")
            text = f.read(min(size, 100_000_000)).decode("utf-8", "replace")
        elif b"\0" in head:
            return None
        else:
            text = (head + f.read()).decode("utf-8", "replace")
    for number, line in enumerate(text.splitlines(), 1):
        kind = find_secret(line)
        if kind:
            return f"line {number} holds {kind}"
    return None


def require_hub_token() -> str:
    """The Hugging Face token from huggingface_hub's usual places; ExportError saying how to set one if none.

    Training with --push_to_hub can call this before it starts, so a missing token is not found hours later."""
    from huggingface_hub import get_token

    token = get_token()
    if token is None:
        raise ExportError("no Hugging Face token: set HF_TOKEN or run `hf auth login`, then push again")
    return token


def push_folder(folder, repo_id: str, private: bool = False, revision: str | None = None, dry_run: bool = False) -> str:
    """Upload an exported folder to the hub model repo `repo_id` (created when missing) in one commit.

    The token comes from huggingface_hub's usual places (HF_TOKEN, `hf auth login`'s cache). With
    `dry_run` nothing is contacted and the plan is printed. Returns the commit URL (or the target URL).
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:  # the hub's own rule, checked before anything is read or contacted, dry run included
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UsageError(f"--repo_id {repo_id!r} is not a valid hub id ({e}); expected USER/NAME or ORG/NAME") from e
    plan = upload_plan(folder)
    branch = revision or "main"
    target = f"https://huggingface.co/{repo_id}/tree/{branch}"
    if dry_run:
        print(f"dry run: would upload {len(plan)} files to {target} ({'private' if private else 'public'} model repo)")
        for path, size in plan:
            print(f"  {path}  ({size:,} bytes)")
        if get_token() is None:
            print("note: no Hugging Face token found; set HF_TOKEN or run `hf auth login` before pushing")
        return target
    api = HfApi(token=require_hub_token())
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        # exactly the planned files (no hidden ones): upload_folder takes them as patterns, in one commit
        commit = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            revision=revision,
            allow_patterns=[path for path, _ in plan],
            commit_message="Upload a model exported by disco-clip-ds",
        )
    except Exception as e:  # the hub's errors (auth, network, permissions) carry their own explanation
        raise ExportError(f"upload to {repo_id} failed: {type(e).__name__}: {e}") from e
    return commit.commit_url
