# frozen_string_literal: true

# Fact `vmhost`: vmhostd's host.info (version, api_version, accel, cpu, memory_mib, hardware,
# vm_count, networks) read from the socket in $VMHOST_SOCKET, else /run/vmhost/vmhostd.sock.
# Absent (nil) when there is no socket or the daemon does not answer within 5 s.
require_relative '../puppet_x/vmhost/client'

Facter.add(:vmhost) do
  setcode do
    path = PuppetX::Vmhost.socket_path
    if File.socket?(path)
      begin
        PuppetX::Vmhost::Client.new(path, timeout: 5).call('host.info')
      rescue PuppetX::Vmhost::Error => e
        Facter.debug("vmhost fact: #{e.message}")
        nil
      end
    else
      Facter.debug("vmhost fact: no vmhostd socket at #{path}")
      nil
    end
  end
end
