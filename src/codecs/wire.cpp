#include "codecs/wire.h"

namespace terse::wire {

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
