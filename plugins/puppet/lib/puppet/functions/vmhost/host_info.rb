# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/client'

# Returns vmhostd's host.info as a hash, read from SOCKET (default: $VMHOST_SOCKET, else
# /run/vmhost/vmhostd.sock) when the catalog is compiled. Unlike the `vmhost` fact, it fails
# the compilation when the daemon cannot be asked, with the reason.
Puppet::Functions.create_function(:'vmhost::host_info') do
  # @param socket vmhostd's API socket
  # @return [Hash] the result of host.info
  dispatch :host_info do
    optional_param 'String[1]', :socket
  end

  def host_info(socket = nil)
    PuppetX::Vmhost::Client.new(socket, timeout: 10).call('host.info')
  rescue PuppetX::Vmhost::Error => e
    raise Puppet::Error, "vmhost::host_info: #{e.message}"
  end
end
