#include "kernels/ref/kv_ref.h"
