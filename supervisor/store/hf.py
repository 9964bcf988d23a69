"""Pull `hf.co/org/repo[:revision]` from Hugging Face: `huggingface_hub.snapshot_download`
into a temporary directory of the store (model files only), then `create` from it, moving
the downloaded files into blobs. The endpoint is huggingface_hub's (HF_ENDPOINT) unless
given."""

from __future__ import annotations

import asyncio
import shutil
import uuid

from mlxr.shared.errors import InsufficientStorage, ModelNotFound, RegistryError

from .create import CreateRequest, create_model
from .files import is_no_space
from .names import DEFAULT_TAG, ModelName
from .shared_job import Emit
from .store import Store

ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken",
                  "NOTICE", "LICENSE*"]


async def pull_huggingface(store: Store, name: ModelName, emit: Emit,
                           endpoint: str | None = None) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    repo_id = f"{name.namespace}/{name.model}"
    revision = None if name.tag == DEFAULT_TAG else name.tag
    work = store.tmp_dir / f"hf-{uuid.uuid4().hex[:12]}"
    emit({"status": f"pulling {repo_id} from Hugging Face"})
    try:
        path = await asyncio.to_thread(
            snapshot_download, repo_id=repo_id, revision=revision, local_dir=str(work),
            allow_patterns=ALLOW_PATTERNS, endpoint=endpoint)
        request = CreateRequest(model=name.full, from_=str(path))
        async for item in create_model(store, request, move_files=True):
            emit(item)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNotFound(f'model "{name.display}" not found on Hugging Face') from None
    except OSError as exc:
        if is_no_space(exc):  # nothing is kept: the download directory goes below
            raise InsufficientStorage(f"no space left on device while pulling {repo_id} from "
                                      "Hugging Face; nothing was kept") from None
        raise RegistryError(f"Hugging Face pull of {repo_id} failed: {exc}") from None
    except (HfHubHTTPError, ValueError) as exc:
        raise RegistryError(f"Hugging Face pull of {repo_id} failed: {exc}") from None
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
