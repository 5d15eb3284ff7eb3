#include "client/kv_client.h"
