// Links the installed kvpool client and creates one (no server needed).
#include <cstdio>
#include "kvpool/kvpool_client.h"
int main() {
  auto c = kvpool::client::KvPoolClient::Create("127.0.0.1:1", kvpool::client::ClientOptions());
  std::printf("client %s\n", c ? "created" : "null");
  return c ? 0 : 1;
}
