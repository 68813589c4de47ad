"""OpenAI Batch API routes: ``/v1/files`` (upload, object, content) and ``/v1/batches`` (create,
retrieve, list, cancel), in OpenAI's shapes so the official client's ``files.create``,
``files.content``, ``batches.create/retrieve/list/cancel`` work unchanged. The jobs run in
:class:`laser.batch.manager.BatchManager`."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ..batch.jobs import InputFileError, check_jsonl
from ..batch.manager import BatchError, BatchManager
from ..store import UnknownCursorError
from .errors import APIError


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # as the generation requests: no coercion between JSON types

    input_file_id: str
    endpoint: str
    completion_window: Any = Field(..., description="OpenAI's '24h' or any duration such as '30m', '4h', '90s'")
    metadata: dict[str, Any] | None = None
    # Laser extension: run a job the latency model says cannot meet its window (with a warning)
    accept_infeasible: bool | None = None


def as_api_error(e: BatchError) -> APIError:
    """The HTTP error of a refused Batch API request (the app's exception handler uses it)."""
    return APIError(e.status, e.message, e.code, e.param, e.headers)


def router(mgr: BatchManager) -> APIRouter:
    """Files and batches routes over one :class:`BatchManager`."""
    router = APIRouter()
    store = mgr.store

    @router.post("/v1/files")
    async def upload_file(file: UploadFile = File(...), purpose: str = Form(...)):
        if purpose != "batch":
            raise APIError(400, f"purpose {purpose!r} is not supported; this server takes files with purpose "
                                "'batch'", "invalid_file_purpose", "purpose")
        data = await file.read()
        try:
            check_jsonl(data)
        except InputFileError as e:
            raise APIError(400, str(e), "invalid_file", "file") from None
        return store.add_file(purpose, file.filename or "upload.jsonl", data)

    @router.get("/v1/files")
    async def list_files(purpose: str | None = None, after: str | None = None,
                         limit: int = Query(10000, ge=1, le=10000), order: Literal["asc", "desc"] = "desc"):
        """OpenAI's file list: newest first (``order=asc``: oldest first), ``limit`` files at most
        after the file ``after``; an unknown ``after`` is a 400 (not the first page again)."""
        try:
            data, more = store.list_files(purpose, after, limit, order)
        except UnknownCursorError as e:
            raise APIError(400, e.message, "invalid_value", "after") from None
        return {"object": "list", "data": data, "has_more": more,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    def file_or_404(file_id: str) -> dict:
        obj = store.file_object(file_id)
        if obj is None:
            raise APIError(404, f"no file with id {file_id!r}", "file_not_found", "file_id")
        return obj

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str):
        return file_or_404(file_id)

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        if not store.delete_file(file_id):
            raise APIError(404, f"no file with id {file_id!r}", "file_not_found", "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        obj = file_or_404(file_id)
        return Response(store.file_bytes(file_id), media_type="application/jsonl",
                        headers={"content-disposition": f'attachment; filename="{obj["filename"]}"'})

    @router.post("/v1/batches")
    async def create_batch(body: CreateBatchRequest):
        return await mgr.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata,
                                body.accept_infeasible)

    @router.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = 20):
        return mgr.list(after, limit)

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str):
        return mgr.batch_object(batch_id)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        return mgr.cancel(batch_id)

    return router
