"""The OpenAI-compatible files and fine-tuning jobs API, and adapters in and out (downloads of a
model's or a checkpoint's adapter, uploads of one trained elsewhere). Views parse, call a service,
shape."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import caller_of, organization_of
from accounts.permissions import check_may_manage_models
from base.api_views import PAGE_PARAMETERS
from base.pagination import list_page
from base.streaming import StreamedFileResponse
from core.api_errors import model_not_found, not_found, object_body
from finetuning import adapters, compositions, files, job_creation, job_status, publishing, registry
from finetuning.models import Composition, File, FineTunedModel, FineTuningJob
from finetuning.representations import (
    checkpoint_object,
    composition_object,
    event_object,
    file_object,
    job_object,
    model_object,
    revision_object,
)
from finetuning.serializers import (
    AdapterUploadSerializer,
    CompositionSerializer,
    FileUploadSerializer,
    JobCreateSerializer,
    RollbackSerializer,
)


class AnyAcceptRenderer(JSONRenderer):
    """File content is raw bytes: accept any Accept header (the openai client sends application/binary).

    Errors on that endpoint are still JSON; the bytes themselves bypass rendering (a streamed response).
    """

    media_type = "*/*"


class OrganizationScoped:
    """Rows of the caller's organization only; anything else is "no such ..." (404)."""

    model: type[File] | type[FineTuningJob] | type[Composition]
    noun: str

    def scoped(self, request: Request) -> QuerySet[Any]:
        return self.model.objects.for_org(organization_of(request))

    def get_row(self, request: Request, pk: str) -> Any:
        row = self.scoped(request).filter(pk=pk).first()
        if row is None:
            raise not_found(self.noun, pk)
        return row


# The schema: OpenAI's objects are plain JSON here (see finetuning.representations). A list answering
# a plain object does not look like a list to drf-spectacular, so the list views name their operation.
_ID = OpenApiParameter("id", str, OpenApiParameter.PATH)
_MODEL = [OpenApiParameter("model", str, OpenApiParameter.PATH, description="<base_model_id>:<suffix>")]
_documented = extend_schema(responses=OpenApiTypes.OBJECT, parameters=[_ID])
_ARCHIVE = {(200, "application/gzip"): OpenApiTypes.BINARY}


@extend_schema_view(
    list=extend_schema(operation_id="v1_files_list", responses=OpenApiTypes.OBJECT, parameters=PAGE_PARAMETERS),
    create=extend_schema(request={"multipart/form-data": FileUploadSerializer}, responses=OpenApiTypes.OBJECT),
    retrieve=_documented,
    destroy=_documented,
    content=_documented,
)
class FileViewSet(OrganizationScoped, viewsets.ViewSet):
    model, noun = File, "file"

    def list(self, request: Request) -> Response:
        queryset = self.scoped(request)
        if purpose := request.query_params.get("purpose"):
            queryset = queryset.filter(purpose=purpose)
        return Response(list_page(request.query_params, queryset, file_object))

    def create(self, request: Request) -> Response:
        serializer = FileUploadSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        created = files.upload_file(organization_of(request), caller_of(request), data["file"], data["purpose"])
        return Response(file_object(created))

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(file_object(self.get_row(request, pk)))

    def destroy(self, request: Request, pk: str) -> Response:
        file = self.get_row(request, pk)
        files.delete_file(file)
        return Response({"id": pk, "object": "file", "deleted": True})

    @action(detail=True, methods=["get"], renderer_classes=[JSONRenderer, AnyAcceptRenderer])
    def content(self, request: Request, pk: str) -> StreamedFileResponse:
        file = self.get_row(request, pk)
        content, content_type = files.open_content(file), files.content_type(file)
        return StreamedFileResponse(content, as_attachment=True, filename=file.filename, content_type=content_type)


@extend_schema_view(
    list=extend_schema(
        operation_id="v1_fine_tuning_jobs_list", responses=OpenApiTypes.OBJECT, parameters=PAGE_PARAMETERS
    ),
    create=extend_schema(request=JobCreateSerializer, responses=OpenApiTypes.OBJECT),
    retrieve=_documented,
    cancel=extend_schema(request=None, responses=OpenApiTypes.OBJECT, parameters=[_ID]),
    events=extend_schema(responses=OpenApiTypes.OBJECT, parameters=[_ID, *PAGE_PARAMETERS]),
    checkpoints=extend_schema(responses=OpenApiTypes.OBJECT, parameters=[_ID, *PAGE_PARAMETERS]),
    checkpoint_adapter=extend_schema(
        summary="Download a checkpoint's adapter (a PEFT folder as .tar.gz)",
        responses=_ARCHIVE,
        parameters=[_ID, OpenApiParameter("checkpoint", str, OpenApiParameter.PATH)],
    ),
)
class JobViewSet(OrganizationScoped, viewsets.ViewSet):
    model, noun = FineTuningJob, "fine-tuning job"

    def scoped(self, request: Request) -> QuerySet[Any]:
        return super().scoped(request).select_related("organization")

    def list(self, request: Request) -> Response:
        return Response(list_page(request.query_params, self.scoped(request), job_object))

    def create(self, request: Request) -> Response:
        serializer = JobCreateSerializer(data=object_body(request.data))
        serializer.is_valid(raise_exception=True)
        job = job_creation.create_job(organization_of(request), caller_of(request), serializer.to_job_request())
        return Response(job_object(job))

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(job_object(self.get_row(request, pk)))

    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        return Response(job_object(job_status.cancel_job(self.get_row(request, pk))))

    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str) -> Response:
        job = self.get_row(request, pk)
        return Response(list_page(request.query_params, job.events.all(), event_object))

    @action(detail=True, methods=["get"])
    def checkpoints(self, request: Request, pk: str) -> Response:
        job = self.get_row(request, pk)
        return Response(list_page(request.query_params, job.checkpoints.select_related("job"), checkpoint_object))

    @action(
        detail=True, methods=["get"], url_path="checkpoints/(?P<checkpoint>[^/]+)/adapter",
        renderer_classes=[JSONRenderer, AnyAcceptRenderer],
    )
    def checkpoint_adapter(self, request: Request, pk: str, checkpoint: str) -> StreamedFileResponse:
        row = self.get_row(request, pk).checkpoints.select_related("job").filter(pk=checkpoint).first()
        if row is None:
            raise not_found("checkpoint", checkpoint)
        return adapters.archive_response(adapters.checkpoint_archive(row), row.name)


class ModelAdapterView(APIView):
    """``GET /v1/fine_tuning/models/{model}/adapter``: a fine-tuned model's adapter. (Not under
    ``/v1/models/``: every path there names a model, and belongs to the gateway.)"""

    renderer_classes = [JSONRenderer, AnyAcceptRenderer]

    @extend_schema(
        operation_id="v1_fine_tuning_models_adapter_retrieve", responses=_ARCHIVE,
        summary="Download a fine-tuned model's adapter (a PEFT folder as .tar.gz)",
        parameters=_MODEL,
    )
    def get(self, request: Request, model: str) -> StreamedFileResponse:
        row = _own_model(request, model)
        return adapters.archive_response(adapters.model_archive(row), row.name)


def _own_model(request: Request, name: str) -> FineTunedModel:
    row = FineTunedModel.objects.for_org(organization_of(request)).filter(name=name).first()
    if row is None:
        raise model_not_found(name)
    return row


class ModelRevisionsView(APIView):
    """``GET /v1/fine_tuning/models/{model}/revisions``: every revision, newest first."""

    @extend_schema(
        operation_id="v1_fine_tuning_models_revisions_list", responses=OpenApiTypes.OBJECT, parameters=_MODEL,
        summary="List a fine-tuned model's revisions (<model>@r<N>), with their jobs and final losses",
    )
    def get(self, request: Request, model: str) -> Response:
        row = _own_model(request, model)
        data = [revision_object(revision, row.revision) for revision in registry.revisions_of(row)]
        return Response({"object": "list", "data": data, "current": row.revision})


class ModelRollbackView(APIView):
    """``POST /v1/fine_tuning/models/{model}/rollback``: answer with another revision from now on."""

    @extend_schema(
        request=RollbackSerializer, responses=OpenApiTypes.OBJECT, parameters=_MODEL,
        summary="Make a fine-tuned model's name answer with one of its revisions (roll back, or forward again)",
    )
    def post(self, request: Request, model: str) -> Response:
        serializer = RollbackSerializer(data=object_body(request.data))
        serializer.is_valid(raise_exception=True)
        row = _own_model(request, model)
        check_may_manage_models(organization_of(request), caller_of(request), "roll back")
        row = publishing.roll_back(row, serializer.validated_data["revision"])
        return Response(model_object(row))


class AdapterUploadView(APIView):
    """``POST /v1/fine_tuning/adapters``: serve an adapter trained elsewhere."""

    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(
        request={"multipart/form-data": AdapterUploadSerializer}, responses=OpenApiTypes.OBJECT,
        summary="Upload a PEFT LoRA adapter (.tar.gz or .zip) to serve as <model>:<suffix>",
    )
    def post(self, request: Request) -> Response:
        serializer = AdapterUploadSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = adapters.upload_adapter(
            organization_of(request), caller_of(request), data["file"], data["model"], data.get("suffix")
        )
        return Response(model_object(model))


class ComposeModelView(APIView):
    """``POST /v1/fine_tuning/models``: a new fine-tuned model composed of the organization's own.
    ``linear`` answers the published model (200); the other methods run on a worker and answer the
    queued composition to poll (202, ``Location`` naming it)."""

    @extend_schema(
        request=CompositionSerializer, responses={200: OpenApiTypes.OBJECT, 202: OpenApiTypes.OBJECT},
        summary="Compose a fine-tuned model from a weighted combination of the organization's fine-tuned models",
    )
    def post(self, request: Request) -> Response:
        serializer = CompositionSerializer(data=object_body(request.data))
        serializer.is_valid(raise_exception=True)
        result = compositions.compose_or_queue(
            organization_of(request), caller_of(request), serializer.to_composition()
        )
        if isinstance(result, FineTunedModel):
            return Response(model_object(result))
        location = f"/v1/fine_tuning/compositions/{result.id}"
        return Response(composition_object(result), status=202, headers={"Location": location})


@extend_schema_view(
    list=extend_schema(
        operation_id="v1_fine_tuning_compositions_list", responses=OpenApiTypes.OBJECT, parameters=PAGE_PARAMETERS
    ),
    retrieve=_documented,
)
class CompositionViewSet(OrganizationScoped, viewsets.ViewSet):
    """``/v1/fine_tuning/compositions``: the compositions built on a worker, newest first, to poll."""

    model, noun = Composition, "composition"

    def scoped(self, request: Request) -> QuerySet[Any]:
        return super().scoped(request).select_related("organization")

    def list(self, request: Request) -> Response:
        return Response(list_page(request.query_params, self.scoped(request), composition_object))

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(composition_object(self.get_row(request, pk)))
