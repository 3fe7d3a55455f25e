"""The Hugging Face Hub, for a run with --push_to_hub: the repository's name (`hub_repo_id`, decided by the plan),
access checked before anything is written (`check_push`), and the published folder uploaded (`push`)."""

import os
from pathlib import Path
from typing import Any

from .args import InputError, UsageError
from .run_dir import STAGING_SUFFIX


def hub_repo_id(output_dir: str | Path, hub_model_id: str | None = None) -> str:
    """The repository a run pushes to: --hub_model_id, else the output folder's name as written (a link's own name,
    not its target's; never the staging name)."""
    if hub_model_id:
        return hub_model_id
    name = Path(os.path.abspath(output_dir)).name
    return name.removesuffix(STAGING_SUFFIX)


def check_push(repo_id: str, token: str | None) -> None:
    """`check_hub_access` in the command's words: a bad name is a usage error, an unreachable Hub an input error."""
    try:
        check_hub_access(repo_id, token)
    except ValueError as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        raise InputError(str(error)) from None


def push(folder: Any, repo_id: str, args: Any) -> str:
    """The published run folder (a RunFolder) uploaded; a failure says the run is safe and how to upload it."""
    try:
        return push_to_hub(folder.output_dir, repo_id, args.hub_token, args.hub_private_repo, args.hub_revision)
    except Exception as error:  # the network, the token, the Hub: the run itself is published already
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"the push to {repo_id} failed ({reason}); the run is safe in {folder.named}: upload it "
                         f"with `hf upload {repo_id} {folder.named}`") from None


def check_hub_access(repo_id: str, token: str | None = None) -> None:
    """Before any work of a run that pushes: a valid repository name (ValueError), a token and a Hub that answers
    (OSError); the run's hours are not spent to fail at the upload."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(f"--push_to_hub: {repo_id!r} is not a hub repository name (letters, digits, '-', '_', '.', "
                         "as name or namespace/name); name it with --hub_model_id") from None
    try:
        HfApi(token=token).whoami()
    except Exception as error:  # no token, an offline machine, a refused token: all the same to the run
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        # A token given is not the fix when it was refused or never sent (offline): the message says what is.
        fix = ("check --hub_token and that the Hub can be reached" if token is not None else
               "log in with `hf auth login` or pass --hub_token")
        raise OSError(f"--push_to_hub: cannot reach the Hub as a logged-in user ({reason}); {fix}, or train "
                      "without --push_to_hub and upload later") from None


def push_to_hub(folder: Path, repo_id: str, token: str | None = None, private: bool | None = None,
                revision: str | None = None) -> str:
    """Upload the finished output folder (model or adapter, tokenizer, card, curves, metrics) to the repository's
    `revision` branch (made if missing; default: main); returns the URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True)
    branch = {}
    if revision is not None:
        api.create_branch(repo.repo_id, branch=revision, exist_ok=True)
        branch = {"revision": revision}
    api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder), commit_message="dpo_min: trained model",
                      ignore_patterns=["checkpoint-*", "checkpoint-*/**"], **branch)
    return repo.url if hasattr(repo, "url") else str(repo)
