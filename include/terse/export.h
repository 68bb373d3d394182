// TERSE_API marks what libterse exports: the public API in include/terse/. The library is built
// with hidden visibility, so anything without it stays internal to the library.
#pragma once

// TERSE_HIDDEN keeps a definition nested in an exported class (its Impl) internal: it and its
// lambdas' type information would otherwise be exported with the class.
#if defined(_WIN32)
#define TERSE_API
#define TERSE_HIDDEN
#else
#define TERSE_API __attribute__((visibility("default")))
#define TERSE_HIDDEN __attribute__((visibility("hidden")))
#endif
