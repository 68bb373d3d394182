// Errors thrown by terse. Every message names what failed and, where it applies, the rank,
// the tensor and the peer, so a distributed failure can be traced from any rank's log.
#pragma once

#include <stdexcept>
#include <string>

#include "terse/export.h"

namespace terse {

// Base of every terse exception; the Python layer maps it to terse.Error with the same text.
class TERSE_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A codec spec or option is malformed, names an unknown codec or key, or is out of range.
class TERSE_API SpecError : public Error {
 public:
  using Error::Error;
};

// A payload is truncated, corrupted, oversized, or was produced by another codec or parameter
// set. Decoders throw it before writing anything out of bounds.
class TERSE_API DecodeError : public Error {
 public:
  using Error::Error;
};

// Arguments that cannot be honoured: mismatched sizes, a buffer too small, NaN or Inf input.
class TERSE_API InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A wait ran past its deadline (a dead or stalled peer).
class TERSE_API TimeoutError : public Error {
 public:
  using Error::Error;
};

// Ranks disagree on what they submitted (size, codec, name, order).
class TERSE_API MismatchError : public Error {
 public:
  using Error::Error;
};

// The transport failed: a peer closed its connection or could not be reached.
class TERSE_API TransportError : public Error {
 public:
  using Error::Error;
};

// A store or peer did not prove the job secret, or refused this process because it could not
// (a different secret, or one side has none). A TransportError, so code that handles lost
// connections handles this too.
class TERSE_API AuthenticationError : public TransportError {
 public:
  using TransportError::TransportError;
};

}  // namespace terse
