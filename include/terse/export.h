// TERSE_API marks what libterse exports: the public API in include/terse/. The library is built
// with hidden visibility, so anything without it stays internal to the library.
#pragma once

#if defined(_WIN32)
#define TERSE_API
#else
#define TERSE_API __attribute__((visibility("default")))
#endif
