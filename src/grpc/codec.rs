//! The protobuf codec of the generated services and clients: prost's, except that a message
//! that cannot be decoded is the caller's mistake, INVALID_ARGUMENT with ErrorInfo reason
//! `MALFORMED_REQUEST`, not INTERNAL (tonic-prost's default).

use std::collections::HashMap;

use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::{Code, Status};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};
use tonic_types::{ErrorDetails, StatusExt};

use crate::error::ERROR_DOMAIN;

/// [`ProstCodec`] with decode errors mapped to INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct LedgerCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for LedgerCodec<T, U> {
    fn default() -> Self {
        Self(ProstCodec::default())
    }
}

impl<T, U> Codec for LedgerCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = LedgerDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        LedgerDecoder(self.0.decoder())
    }
}

/// Decodes like prost; a malformed message becomes INVALID_ARGUMENT.
#[derive(Debug)]
pub struct LedgerDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for LedgerDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buffer: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buffer).map_err(|status| {
            if status.code() != Code::Internal {
                return status;
            }
            let mut details = ErrorDetails::new();
            details.set_error_info("MALFORMED_REQUEST", ERROR_DOMAIN, HashMap::new());
            Status::with_error_details(Code::InvalidArgument, "the request is not a valid protobuf message", details)
        })
    }
}
