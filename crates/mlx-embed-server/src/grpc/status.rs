//! gRPC status codes: what an error kind of the HTTP routes is over gRPC
//! (TEI's mapping), and their names as the metrics and logs give them.

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::errors::{ApiError, ErrorKind};

/// The gRPC status code of an error kind, as TEI's gRPC server maps its
/// error types: a request at fault is `INVALID_ARGUMENT`, overload
/// `RESOURCE_EXHAUSTED`, a model that cannot answer (or a server that is
/// draining) `UNAVAILABLE`, a model that failed on the request
/// `FAILED_PRECONDITION` (TEI's code for its backend's errors).
pub(crate) fn code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidRequest | ErrorKind::Unprocessable | ErrorKind::UnsupportedMediaType => {
            Code::InvalidArgument
        }
        ErrorKind::Unauthorized => Code::Unauthenticated,
        ErrorKind::Forbidden => Code::PermissionDenied,
        ErrorKind::Timeout => Code::DeadlineExceeded,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::MethodNotAllowed | ErrorKind::NotImplemented => Code::Unimplemented,
        // A size limit (--max-inputs-per-request, the per-token answer's
        // cap): gRPC's code for a message over a limit.
        ErrorKind::TooLarge => Code::ResourceExhausted,
        ErrorKind::Overloaded => Code::ResourceExhausted,
        ErrorKind::Model => Code::FailedPrecondition,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::ClientClosed => Code::Cancelled,
    }
}

/// Metadata on a status that is the client's mistake under a code that is
/// mostly the server's (a wrong method's `FAILED_PRECONDITION`): the log
/// gives it at debug, as HTTP's 4xx, not at warn. Taken off before the
/// status goes out (`super::serve`).
pub(crate) const CLIENT_FAULT: &str = "x-mlx-embed-client-fault";

/// `err` as a gRPC status: its code ([`code`]) and message. A method the
/// served model cannot answer (an Embed to a classifier, a Rerank to an
/// embedder: the path's refusal names `model`, which no gRPC message
/// carries) is `FAILED_PRECONDITION`, TEI's code for it, not a fault of the
/// request's fields: a TEI client tells the two apart by code. It is still
/// the client's mistake, marked [`CLIENT_FAULT`].
pub(crate) fn status(err: ApiError) -> Status {
    let wrong_model =
        err.kind == ErrorKind::InvalidRequest && err.param.as_deref() == Some("model");
    if !wrong_model {
        return Status::new(code(err.kind), err.message);
    }
    let mut status = Status::new(Code::FailedPrecondition, err.message);
    status
        .metadata_mut()
        .insert(CLIENT_FAULT, MetadataValue::from_static("1"));
    status
}

/// gRPC's name of a status code, as its specification writes it.
pub(crate) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// tonic's refusal of a message over the decoding limit (`OUT_OF_RANGE`)
/// as gRPC's own servers answer it, `RESOURCE_EXHAUSTED`, naming the flag
/// that sets the limit. Any other status is left as it is.
pub(crate) fn size_status(status: Status) -> Status {
    const TONIC_TOO_LARGE: &str = "Error, decoded message length too large";
    if status.code() != Code::OutOfRange || !status.message().starts_with(TONIC_TOO_LARGE) {
        return status;
    }
    let detail = status.message().trim_start_matches("Error, ");
    Status::resource_exhausted(format!(
        "message larger than the server takes (--max-body-bytes): {detail}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_that_cannot_answer_the_method_is_a_failed_precondition() {
        // As the path refuses it (crate::models::resolve): TEI's code.
        let wrong =
            ApiError::invalid("this route needs a reranker; this server serves x").param("model");
        let s = status(wrong);
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.metadata().contains_key(CLIENT_FAULT));
        assert_eq!(
            s.message(),
            "this route needs a reranker; this server serves x"
        );
        let field = ApiError::invalid("inputs: empty").param("inputs");
        assert_eq!(status(field).code(), Code::InvalidArgument);
        // A model that failed on the request is the server's failure.
        let failed = status(ApiError::new(ErrorKind::Model, "the model failed"));
        assert_eq!(failed.code(), Code::FailedPrecondition);
        assert!(!failed.metadata().contains_key(CLIENT_FAULT));
    }

    #[test]
    fn error_kinds_map_to_tei_codes() {
        let cases = [
            (ErrorKind::InvalidRequest, Code::InvalidArgument),
            (ErrorKind::Unprocessable, Code::InvalidArgument),
            (ErrorKind::Unauthorized, Code::Unauthenticated),
            (ErrorKind::Overloaded, Code::ResourceExhausted),
            (ErrorKind::TooLarge, Code::ResourceExhausted),
            (ErrorKind::Unavailable, Code::Unavailable),
            (ErrorKind::Model, Code::FailedPrecondition),
            (ErrorKind::ClientClosed, Code::Cancelled),
        ];
        for (kind, want) in cases {
            assert_eq!(code(kind), want, "{kind:?}");
        }
        let s = status(ApiError::shutting_down());
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(s.message(), "server is shutting down; retry elsewhere");
    }

    #[test]
    fn tonics_size_refusal_becomes_resource_exhausted() {
        let tonic = Status::out_of_range(
            "Error, decoded message length too large: found 9 bytes, the limit is: 4 bytes",
        );
        let s = size_status(tonic);
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(
            s.message(),
            "message larger than the server takes (--max-body-bytes): decoded message length \
             too large: found 9 bytes, the limit is: 4 bytes"
        );
        let other = size_status(Status::out_of_range("something else"));
        assert_eq!(other.code(), Code::OutOfRange);
    }

    #[test]
    fn code_names_are_grpcs() {
        assert_eq!(code_name(Code::InvalidArgument), "INVALID_ARGUMENT");
        assert_eq!(code_name(Code::Ok), "OK");
    }
}
