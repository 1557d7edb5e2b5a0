"""What may be shown of a data source: `--train_shards` without its secrets or shell commands, for run.json, the model
card and log lines, and the secret patterns `disco-clip push` refuses to upload.

Gated shards are commonly read through a command holding a credential (`pipe:curl -s -H 'Authorization: Bearer
hf_...' https://host/{00000..00007}.tar`), or from a URL carrying one (`https://user:password@host/...`,
`...?token=...`). The public description of a source keeps what identifies the data and nothing that grants access
to it or names the machine it was read on:
- a `pipe:` command: `pipe: ` and the URLs in it, as below (the command itself is dropped);
- a URL: scheme, host and path; any user:password dropped, every query value replaced by ***;
- a local path: its last component (with its folder's name when that is a shard file pattern).
Each description is its own description (applying `describe_shards` twice changes nothing), so a run.json written
before this module existed and one written after are shown alike.
"""

from __future__ import annotations

import html
import re
import shlex
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qsl, urlsplit, urlunsplit

HIDDEN = "***"
_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.I)

# (what it is, pattern): the credentials a data source, a shell command or a config commonly carries. The patterns
# match the secret itself, so that redaction keeps the words around it.
SECRETS = (
    ("a Hugging Face token (hf_...)", re.compile(r"\bhf_[A-Za-z0-9]{20,}")),
    ("an HTTP bearer token (Bearer ...)", re.compile(r"(?<=\bBearer\s)\s*[A-Za-z0-9._~+/-]{12,}=*")),
    ("an AWS access key id (AKIA...)", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    (
        "an AWS secret access key",
        re.compile(r"(?i)(?<=aws_secret_access_key)(?:\s*[=:]\s*|\s+)['\"]?[A-Za-z0-9/+=]{30,}"),
    ),
    ("a password in a URL (user:password@)", re.compile(r"(?<=://)[^/\s:@'\"]+:[^/\s@'\"]+(?=@)")),
    ("a GitHub token (ghp_..., github_pat_...)", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{40,})")),
    ("an API key (sk-...)", re.compile(r"\bsk-[A-Za-z0-9_-]{20,}")),
    ("a Slack token (xox.-...)", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
    (
        "a token in a URL query (token=...)",
        re.compile(
            r"(?i)(?<=[?&])(?:token|access_token|auth|sig|signature|x-amz-signature|x-amz-credential|"
            r"x-amz-security-token|key|api_key|apikey|password|secret)=[^&\s'\"]+"
        ),
    ),
)


def find_secret(text: str) -> str | None:
    """What kind of known secret `text` holds (one of SECRETS' names), or None."""
    return next((kind for kind, pattern in SECRETS if pattern.search(text)), None)


def redact_text(text: str) -> str:
    """`text` with every known secret (SECRETS) replaced by ***, for lines that must keep their other words."""
    for _, pattern in SECRETS:
        text = pattern.sub(HIDDEN, text)
    return text


def describe_url(url: str) -> str:
    """A URL's scheme, host and path; a user:password dropped, each query value hidden; `file:` URLs as a path."""
    parts = urlsplit(url)
    if parts.scheme.lower() == "file":
        return describe_path(parts.path)
    query = "&".join(f"{name}={HIDDEN}" for name, _ in parse_qsl(parts.query, keep_blank_values=True))
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, query, ""))


# folder names that say which split, not which data: such a folder is shown with its parent (`demo/train`)
SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "eval", "test"})


def describe_path(path: str) -> str:
    """A local path's last component; a shard pattern or tar file keeps its folder's name (`train/{0..7}.tar`), and a
    split's folder (SPLIT_NAMES) its parent's (`demo/train`), unless that parent is a home folder's user name."""
    parts = [p for p in PurePosixPath(path).parts if p != "/"]
    if not parts:
        return path
    keep = 2 if len(parts) > 1 and ("{" in parts[-1] or parts[-1].endswith(".tar")) else 1
    if len(parts) > keep and parts[-keep] in SPLIT_NAMES and not _home_of(parts[:-keep]):
        keep += 1
    return "/".join(parts[-keep:])


def _home_of(parent: list[str]) -> bool:
    """Whether `parent` (a path's components) is a home folder, whose name is a user's: /home/USER, /Users/USER."""
    return (len(parent) == 2 and parent[0] in ("home", "Users")) or parent[-1:] == [PurePosixPath(Path.home()).name]


def describe_source(source: str) -> str:
    """The public description of one shard source (a `pipe:` command, a URL or a local path)."""
    source = source.strip()
    if source.startswith("pipe:"):
        command = source[len("pipe:") :]
        urls = _URL.findall(command)
        if urls:
            return "pipe: " + " ".join(describe_url(url) for url in urls)
        paths = [word for word in _words(command) if "/" in word or word.endswith(".tar")]
        return f"pipe: {describe_path(paths[-1])}" if paths else f"pipe: {HIDDEN}"
    if _URL.match(source):
        return describe_url(source)
    return describe_path(source)


def describe_shards(spec: str) -> str:
    """The public description of a `--train_shards` value: each '::'-joined source by `describe_source`."""
    return "::".join(describe_source(s) for s in spec.split("::") if s.strip())


_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~<-])~?/[^\s,;<>]+")
_MARKDOWN = re.compile(r"([\\`*\[\]|])")  # what would break a table cell or start a link, code span or emphasis


def describe_data(data: str) -> str:
    """run.json's `data` as it may be shown: a `datasets ...` description (data.hf_io.describe_source) with its
    secrets hidden and absolute paths shortened to their last component; else a `--train_shards` value
    (`describe_shards`). A run.json of an older version, which recorded the source verbatim, is shown alike."""
    if data.startswith("datasets "):
        return _ABSOLUTE_PATH.sub(lambda m: describe_path(m.group(0)), redact_text(data))
    return describe_shards(data)


def public_text(text: str) -> str:
    """`text` as it may go into a model card or suite.md, whatever it holds: known secrets hidden (`redact_text`),
    absolute local paths shortened to their last parts (`describe_path`), one line, and Markdown's and HTML's
    special characters escaped, so that a value stays one table cell and renders as the text it is."""
    text = _ABSOLUTE_PATH.sub(lambda m: describe_path(m.group(0)), redact_text(str(text)))
    text = " ".join(text.split())
    return _MARKDOWN.sub(r"\\\1", html.escape(text, quote=False))


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # unbalanced quotes: the words as written
        return command.split()
