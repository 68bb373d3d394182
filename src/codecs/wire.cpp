// The out-of-line parts of terse/codec_kit.h's payload reader and writer.
#include <string>

#include "codecs/wire.h"

namespace terse::wire {

void Writer::overflow(std::size_t n) const {
  throw InvalidArgument("terse: encode buffer too small (" + std::to_string(out_.size()) +
                        " bytes, need " + std::to_string(pos_ + n) + ")");
}

void Reader::need(std::size_t n) const {
  if (n > in_.size() - pos_) {
    throw DecodeError(std::string("terse: truncated ") + what_ + " payload: need " +
                      std::to_string(pos_ + n) + " bytes, have " + std::to_string(in_.size()));
  }
}

void Reader::expect_end() const {
  if (pos_ != in_.size()) {
    throw DecodeError(std::string("terse: ") + what_ + " payload has " +
                      std::to_string(in_.size() - pos_) + " trailing bytes");
  }
}

}  // namespace terse::wire
