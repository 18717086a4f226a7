// Stand-in for MLX's steel/defines.h in harness builds: g++ rejects clang's loop pragmas under -Werror.
#pragma once

#define STEEL_CONST static constexpr const
#define STEEL_PRAGMA_UNROLL
#define STEEL_PRAGMA_NO_UNROLL
